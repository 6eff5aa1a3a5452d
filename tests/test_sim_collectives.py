"""``paired.py --sim-collectives one-kernel`` (``benchmarks/benchlib/collectives.py``): under torch's fake process group
each collective writes its output bytes with one operator that writes, where the fake group's all-gather makes N
copies and its all-reduce none; another backend keeps its own."""

import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from benchlib import collectives  # noqa: E402
from thunder_fp8shard.testing.harness import run_simulated  # noqa: E402


def _writes(fn) -> list[str]:
    """The operators ``fn`` runs that write (in-place aten ops, and the fake group's own c10d ops), in order."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events() if e.name.startswith(("aten::", "c10d::"))
            and (e.name.endswith("_") or e.name == "aten::cat")]


def _collectives(rank, world_size):
    from torch.distributed.distributed_c10d import AllgatherOptions

    group, n = dist.group.WORLD, world_size
    inp, big = torch.arange(3.0) + 1, torch.arange(3.0 * n)
    out, part, amax = torch.empty(3 * n), torch.full((3,), -1.0), torch.tensor([0.5, 2.0])
    calls = {
        "all_gather": lambda: dist.all_gather_into_tensor(out, inp),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, big),
        "all_reduce": lambda: dist.all_reduce(amax, op=dist.ReduceOp.MAX),
        "allgather_base": lambda: group._allgather_base(out, inp, AllgatherOptions()),
    }
    # a bucket's coalesced all-gather as the pass issues it: outputs in order in one buffer, gaps between them
    ins = [torch.arange(3, dtype=torch.uint8) + 1, torch.arange(5, dtype=torch.uint8) + 7]
    buf = torch.full((3 * n + 4 + 5 * n,), 255, dtype=torch.uint8)
    outs = [buf[: 3 * n], buf[3 * n + 4 :]]
    calls["coalesced"] = lambda: group.allgather_into_tensor_coalesced(outs, ins, AllgatherOptions())
    got = {"fake": {name: _writes(fn) for name, fn in calls.items()}}
    collectives.install()
    try:
        for fn in calls.values():
            fn()  # the first call makes the all-reduce's cached scalar
        got["one"] = {name: _writes(fn) for name, fn in calls.items()}
        out.zero_()
        work = dist.all_gather_into_tensor(out, inp, async_op=True)
        got["work"] = (work.wait(), work.is_completed(), work.get_future().wait()[0] is out)
        got["values"] = (out.clone(), part.clone(), amax.clone(), buf.clone())
        got["calls"] = dict(collectives.calls)
    finally:
        collectives.uninstall()
    return got


@pytest.mark.simulated
def test_each_collective_is_one_writing_operator_where_the_fake_group_makes_n_copies():
    n = 4
    got = run_simulated(_collectives, n)
    assert got["fake"]["all_gather"].count("aten::copy_") == n  # the fake group: one copy a chunk
    assert got["fake"]["all_reduce"] == ["c10d::allreduce_"]  # and nothing written for an all-reduce
    assert got["one"] == {"all_gather": ["aten::cat"], "reduce_scatter": ["aten::copy_"],
                          "all_reduce": ["aten::mul_"], "allgather_base": ["aten::cat"], "coalesced": ["aten::cat"]}
    assert got["work"] == (True, True, True)
    gathered, part, amax, bucket = got["values"]
    assert bucket.tolist() == [1, 2, 3] * n + [0] * 4 + [7, 8, 9, 10, 11] * n  # the gap written with zeros
    assert torch.equal(gathered, (torch.arange(3.0) + 1).repeat(n))  # every chunk is this rank's input
    assert torch.equal(part, torch.arange(3.0))  # rank 0's own chunk of the input
    assert torch.equal(amax, torch.tensor([0.5, 2.0]))  # rewritten with its own values
    assert "delegated" not in got["calls"] and got["calls"]["_allgather_base"] >= 3


def test_another_backend_keeps_its_own_collectives(single_rank_group):
    original = dist.ProcessGroup.allreduce
    collectives.install()
    try:
        t = torch.tensor([1.0, 3.0])
        before = collectives.calls["delegated"]
        dist.all_reduce(t, group=single_rank_group)
        out = torch.empty(2)
        dist.all_gather_into_tensor(out, t, group=single_rank_group)
        assert collectives.calls["delegated"] == before + 2 and torch.equal(out, t)
    finally:
        collectives.uninstall()
    assert dist.ProcessGroup.allreduce is original
