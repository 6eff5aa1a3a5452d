"""The replay of torch.compile regions (``thunder_fp8shard.analysis.aliasing``) on fake tensors: a region whose bound symbols
name a device (on the GPU: "Tensor on device meta is not on the expected device cuda:0!" when it was replayed on meta
tensors) is replayed on the inputs' own device, and a replay that fails raises where the tests ask for it."""

import pytest
import torch

from thunder_fp8shard.analysis import aliasing
from thunder_fp8shard.analysis.aliasing import STRICT_ENV, is_torch_compile_region, region_aliasing


def _named_device(x, y):
    # torch.ones(..., device=cpu) in the region: a tensor made on a device the region names
    z = torch.cat((torch.mul(x, torch.ones(2, 4, device=torch.device("cpu"))), y), 0)
    return z, z[:2]


def _replay_within_a_compilation(fn, *args):
    """Every torch.compile region of ``fn``'s executed trace, replayed where the pass replays them (in a transform's
    post-optimization step), with what the replay says."""
    import thunder
    from thunder.core.transform_common import Transform

    from thunder_fp8shard.testing.executors import cat_executor

    found = []

    class Replay(Transform):
        def transform_trace_post_optimization(self, trace, **kwargs):
            found.extend((b, region_aliasing(b)) for b in trace.bound_symbols if is_torch_compile_region(b))
            return trace

    jf = thunder.jit(fn, executors=[cat_executor("cpu"), *thunder.get_default_executors()], transforms=[Replay()])
    jf(*args)
    return found


def test_a_region_naming_a_device_is_replayed(monkeypatch):
    monkeypatch.setenv(STRICT_ENV, "1")
    aliasing._cache.clear()
    found = _replay_within_a_compilation(_named_device, torch.randn(2, 4), torch.randn(3, 4))
    (region, said), = found
    z, head = [o.name for o in region.flat_outs][-2:]
    # z[:2] views the buffer the region allocates for z: one storage, z's 80 bytes
    assert said.shared == (((z, head), 80),) and said.views_of == {}


def test_a_replay_that_fails_raises_under_the_strict_flag_and_warns_without(monkeypatch, caplog):
    def broken(key, bsym):
        raise RuntimeError("Tensor on device meta is not on the expected device cuda:0!")

    monkeypatch.setattr(aliasing, "_replayed", broken)
    monkeypatch.setenv(STRICT_ENV, "1")
    with pytest.raises(Exception, match="could not replay TorchCompile"):
        _replay_within_a_compilation(_named_device, torch.randn(2, 4), torch.randn(3, 4))
    monkeypatch.setenv(STRICT_ENV, "0")
    (_, said), = _replay_within_a_compilation(_named_device, torch.randn(2, 4), torch.randn(3, 4))
    assert said == aliasing.NO_ALIASING and "could not replay TorchCompile" in caplog.text
