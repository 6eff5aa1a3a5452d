"""The run-time operators on one process: a round trip through shard, gather and wait, and what each keeps alive."""

import gc
import weakref

import pytest
import torch

from thunder_fp8shard import ops, payload


class Holder:
    """Stands for a TransformerEngine tensor: an object that keeps its small state and lends out its large buffer."""

    def __init__(self, data: torch.Tensor):
        self.data, self.scale = data, torch.ones(1)


class HolderPayload:
    name = "test_holder"

    def matches(self, obj):
        return isinstance(obj, Holder)

    def take(self, obj):
        data, obj.data = obj.data, None
        return [data], obj

    def give(self, state, buffers):
        state.data = buffers[0]
        return state


@pytest.fixture(scope="module", autouse=True)
def holder_kind():
    payload.register_payload_kind(HolderPayload())
    yield
    payload._KINDS[:] = [k for k in payload._KINDS if k.name != HolderPayload.name]
    payload._BY_NAME.pop(HolderPayload.name)


def _round_trip(group, objs):
    shard, restorer = ops._shard_impl(tuple(objs), group, 1, 0, "slice", False, tuple(f"t{i}" for i in range(len(objs))))
    handle = ops._gather_start_impl(shard, group)
    return restorer, ops._gather_wait_impl(handle, restorer)


def test_members_come_back_as_aligned_views_of_one_buffer(single_rank_group):
    a, b = torch.randn(3, 5), torch.arange(7, dtype=torch.int16)
    holder = Holder(torch.randint(0, 255, (4, 4), dtype=torch.uint8))
    expected = [a.clone(), b.clone(), holder.data.clone()]
    _, (ra, rb, rh) = _round_trip(single_rank_group, [a, b, holder])
    assert torch.equal(ra, expected[0]) and torch.equal(rb, expected[1])
    assert rh is holder and torch.equal(holder.data, expected[2])  # the same object, its buffer handed back
    base = ra.untyped_storage().data_ptr()
    assert rb.untyped_storage().data_ptr() == base == holder.data.untyped_storage().data_ptr()
    assert all((t.data_ptr() - base) % 256 == 0 for t in (ra, rb, holder.data))


def test_the_restorer_keeps_nothing_alive_after_the_wait(single_rank_group):
    """Thunder's autograd context keeps the saved non-tensors (the restorers) until the whole backward is done: a
    restorer still holding a restored object would keep every gathered buffer alive that long."""
    holder = Holder(torch.randint(0, 255, (64,), dtype=torch.uint8))
    restorer, (restored,) = _round_trip(single_rank_group, [holder])
    alive = weakref.ref(holder)
    del holder, restored
    gc.collect()
    assert alive() is None, "the restorer still references the restored object"
    assert restorer.members == ()
    with pytest.raises(RuntimeError, match="restored twice"):
        ops._gather_wait_impl(ops._gather_start_impl(torch.zeros(64, dtype=torch.uint8), single_rank_group), restorer)
