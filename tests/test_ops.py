"""The run-time operators on one process: a round trip through shard, gather and wait, and what each keeps alive."""

import gc
import weakref

import pytest
import torch

from thunder_fp8shard.runtime import ops
from thunder_fp8shard.runtime import payload
from thunder_fp8shard.planning.layout import bucket_layout, packed_offsets


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
    payload.unregister_payload_kind(HolderPayload.name)


def _shard(group, buckets):
    """One shard op over ``buckets`` (lists of objects) on a one-rank group: the shard and a restorer a bucket."""
    sizes = [bucket_layout([payload.nbytes(o.data if isinstance(o, Holder) else o) for o in objs], 1).shard_nbytes
             for objs in buckets]
    offsets, total = packed_offsets(sizes)
    names = tuple(tuple(f"t{i}" for i in range(len(objs))) for objs in buckets)
    shard, *restorers = ops._shard(tuple(map(tuple, buckets)), ops.ShardSpec(group, 1, sizes, "slice", False, names))
    assert shard.numel() == total
    return shard, restorers, offsets, sizes


def _round_trip(group, objs):
    shard, (restorer,), _, _ = _shard(group, [objs])
    handle = ops._gather_start(shard, 0, shard.numel(), 1, group)
    return restorer, ops._gather_wait(handle, restorer)


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


def test_a_0_dim_member_beside_members_of_other_dtypes_round_trips(single_rank_group):
    """A scalar (a per-tensor scale, saved under ``candidates="all", min_bytes=0``) in a bucket whose members have
    several dtypes: the shard op copies its bytes as ``uint8`` like the others' (a 0-dim tensor has no dimension to
    view as bytes), and it comes back a 0-dim tensor with its value."""
    scale = torch.tensor(0.125)
    objs = [torch.arange(12, dtype=torch.float32).to(torch.float8_e4m3fn), scale,
            torch.arange(6, dtype=torch.float32).reshape(2, 3)]
    _, out = _round_trip(single_rank_group, objs)
    assert out[1].shape == () and out[1].dtype == torch.float32 and out[1].item() == 0.125
    assert torch.equal(out[0].view(torch.uint8), objs[0].view(torch.uint8)) and torch.equal(out[2], objs[2])


def test_the_restorer_keeps_nothing_alive_after_the_wait(single_rank_group):
    """Thunder's autograd context keeps the saved non-tensors (the restorers) until the whole backward is done: a
    restorer still holding a restored object would keep every gathered buffer alive that long."""
    holder = Holder(torch.randint(0, 255, (64,), dtype=torch.uint8))
    restorer, (restored,) = _round_trip(single_rank_group, [holder])
    alive = weakref.ref(holder)
    del holder, restored
    gc.collect()
    assert alive() is None, "the restorer still references the restored object"
    assert restorer.taken
    with pytest.raises(RuntimeError, match="restored twice"):
        ops._gather_wait(ops._gather_start(torch.zeros(64, dtype=torch.uint8), 0, 64, 1, single_rank_group),
                              restorer)


def test_one_shard_op_keeps_several_buckets_and_each_comes_back_from_its_offset(single_rank_group):
    a, b, c = torch.randn(3, 5), torch.arange(7, dtype=torch.int16), torch.randn(2, 2, dtype=torch.float64)
    expected = [t.clone() for t in (a, b, c)]
    shard, restorers, offsets, sizes = _shard(single_rank_group, [[a, b], [c]])
    # a at 0, b at 256 (aligned) in the first bucket; the second bucket's shard packed right after: at 270
    assert shard.numel() == 270 + 32 and offsets == (0, 270) and sizes == [270, 32]
    (ra, rb) = ops._gather_wait(ops._gather_start(shard, 0, 270, 1, single_rank_group), restorers[0])
    (rc,) = ops._gather_wait(ops._gather_start(shard, 270, 32, 1, single_rank_group), restorers[1])
    assert all(torch.equal(x, y) for x, y in zip((ra, rb, rc), expected))


def test_gather_next_waits_for_one_bucket_and_starts_the_next_in_one_call(single_rank_group):
    a, b, c = torch.randn(3, 5), torch.arange(7, dtype=torch.int16), torch.randn(2, 2, dtype=torch.float64)
    expected = [t.clone() for t in (a, b, c)]
    shard, restorers, offsets, sizes = _shard(single_rank_group, [[a, b], [c]])
    first = ops._gather_start(shard, offsets[0], sizes[0], 1, single_rank_group)
    ra, rb, second = ops._gather_next(first, restorers[0], shard, offsets[1], sizes[1], 1, single_rank_group)
    assert isinstance(second, ops.GatherHandle) and second.buffer.numel() == sizes[1] and restorers[0].taken
    (rc,) = ops._gather_wait(second, restorers[1])
    assert all(torch.equal(x, y) for x, y in zip((ra, rb, rc), expected))


def test_a_shard_op_works_its_layout_out_again_when_its_buffers_change_shape(single_rank_group):
    """The op keeps what it worked out on its first call (in its spec) only while the buffers keep their kinds,
    shapes and dtypes: other shapes of the same bytes come back with their own shape."""
    spec = ops.ShardSpec(single_rank_group, 1, (60,), "slice", False, (("t0",),))
    for shape in ((3, 5), (3, 5), (5, 3), (15,)):
        t = torch.randn(shape)
        shard, restorer = ops._shard(((t,),), spec)
        (back,) = ops._gather_wait(ops._gather_start(shard, 0, 60, 1, single_rank_group), restorer)
        assert back.shape == shape and torch.equal(back, t)


def test_a_non_contiguous_member_comes_back_contiguous_with_its_values(single_rank_group):
    t = torch.randn(5, 7).t()  # (7, 5), strides (1, 7)
    shard, (restorer,), _, _ = _shard(single_rank_group, [[t, torch.arange(3.0)]])
    back, _ = ops._gather_wait(ops._gather_start(shard, 0, shard.numel(), 1, single_rank_group), restorer)
    assert back.is_contiguous() and torch.equal(back, t)


def test_a_shard_op_refuses_payloads_of_another_size_than_planned(single_rank_group):
    with pytest.raises(RuntimeError, match="the plan said 8 B"):
        ops._shard(((torch.zeros(4),),), ops.ShardSpec(single_rank_group, 1, (8,), "slice", False, (("t0",),)))


def _shard_and_gather_on_ranks(rank: int, world_size: int, method: str) -> list[bool]:
    """Every rank holds the same tensors (odd sizes: padding, pieces across segment borders); one shard op keeps
    two buckets; each bucket is gathered back from its offset and must equal the original on every rank."""
    import torch.distributed as dist

    torch.manual_seed(0)
    originals = [torch.randn(5, 7), torch.arange(11, dtype=torch.int16), torch.randn(3, 3, dtype=torch.float64)]
    buckets = [[t.clone() for t in originals[:2]], [originals[2].clone()]]
    sizes = [bucket_layout([payload.nbytes(t) for t in b], world_size).shard_nbytes for b in buckets]
    offsets, total = packed_offsets(sizes)
    group = dist.group.WORLD
    spec = ops.ShardSpec(group, world_size, sizes, method, False, (("a", "b"), ("c",)))
    shard, *restorers = ops._shard(tuple(map(tuple, buckets)), spec)
    assert shard.numel() == total
    back = [t for off, n, r in zip(offsets, sizes, restorers)
            for t in ops._gather_wait(ops._gather_start(shard, off, n, world_size, group), r)]
    return [torch.equal(x, y) for x, y in zip(back, originals)]


@pytest.mark.multirank
@pytest.mark.parametrize("method", ["slice", "reduce_scatter"])
def test_a_shard_op_of_two_buckets_round_trips_on_three_ranks(method, on_ranks):
    assert on_ranks(_shard_and_gather_on_ranks, 3, method) == [[True, True, True]] * 3


def test_a_shard_op_makes_the_compact_copies_it_is_given_after_its_restorers(single_rank_group):
    qkv = torch.randn(2, 8, 3 * 16)
    v = qkv[..., 32:].view(2, 8, 2, 8).transpose(1, 2)  # a strided view of a third of qkv
    w = torch.arange(12.0)
    spec = ops.ShardSpec(single_rank_group, 1, (bucket_layout([48], 1).shard_nbytes,), "slice", False, (("w",),))
    shard, restorer, copy = ops._shard(((w,),), spec, (v,))
    assert isinstance(restorer, ops.Restorer) and torch.equal(copy, v)
    assert copy.untyped_storage().nbytes() == v.numel() * 4 and copy.untyped_storage() is not v.untyped_storage()
    assert sorted(range(4), key=lambda d: -copy.stride(d)) == sorted(range(4), key=lambda d: -v.stride(d))
    assert ops._shard(((w,),), spec)[2:] == ()  # without views: the shard and its restorers only


def test_compact_copies_work_the_dimension_orders_out_once_and_again_when_strides_change():
    copies = ops.CompactCopies()
    a = torch.randn(4, 6).t()
    (c,) = copies((a,))
    assert torch.equal(c, a) and c.stride() == a.stride() and copies.orders == [[1, 0]]
    kept = copies.orders
    b = a + 1
    assert b.stride() == a.stride()
    copies((b,))  # same strides: the orders are kept, not worked out again
    assert copies.orders is kept
    (c,) = copies((torch.randn(4, 6),))  # other strides: worked out again
    assert copies.orders == [[0, 1]] and c.is_contiguous()
