"""Every rank compiles the same plan (thunder_fp8shard.distributed.agreement), on real gloo ranks: the plan's per-rank inputs are
agreed before planning, and where the ranks' layouts still differ every rank realizes rank 0's before any collective
of the plan runs. (The pure parts and the fake process group: tests/test_agreement.py.)

The multi-rank scenarios of one world size run in one call on the session's gloo workers (one run without the pass
for all of them); each test reads its own scenario. In every scenario the ranks' own inputs would give different
buckets (toy-model plans measured with uniform inputs: resident 0 B groups the weight copies' shards into 2 shard
ops, 200 MB into 3; budget 79,000 B with resident 0 B shards one tensor, with 800 B two; peak with loss 0 B shards
two, with 100,000 B three): without the agreement gloo aborts on a collective mismatch.
"""

from __future__ import annotations

import pytest
import torch

from thunder_fp8shard.distributed.agreement import collectives
from thunder_fp8shard.plan import AGREED, GIVEN, MEASURED
from thunder_fp8shard.reporting.plan_text import plan_text
from thunder_fp8shard.testing.reference_run import RunConfig, mismatches, train

pytestmark = pytest.mark.multirank

WIDTHS = (25, 61, 47, 7)  # the weight copies hold 1,525, 2,867 and 329 bytes (min_bytes=0 shards them)
MB200 = 200 << 20
BASE = dict(widths=WIDTHS, batch_sizes=(3,), no_grad_call=False)


def _planted_probe(rank):
    """What a rank's device would say while compiling: rank r holds r x 200 MB and a cuBLAS workspace of 1 << (10 + r)
    bytes, and every rank but the first could not force a TE GEMM workspace (one more memory term there: unknown);
    on the CPU nothing is measured, so the test injects the device probe the transform reads."""
    from thunder_fp8shard.memory.device import DeviceMemory, DeviceProbe

    class Planted(DeviceProbe):
        def while_compiling(self, trace, *, transformer_engine, cublas=True):
            failed = (("TransformerEngine GEMM", "planted: CUDA out of memory"),) if rank else ()
            return DeviceMemory("cpu", rank * MB200, (("cuBLAS", 1 << (10 + rank)),), failed)

    return Planted()


def _drop_last_bucket_on_the_last_rank(rank, world_size):
    """A plan that differs after agreement: the last rank leaves out its last bucket (the planner's choice, injected)."""
    from dataclasses import replace

    from thunder_fp8shard.planning.planner import choose

    def perturbed(*args, **kwargs):
        choice = choose(*args, **kwargs)
        return replace(choice, buckets=choice.buckets[:-1]) if rank == world_size - 1 else choice

    return perturbed


def run_scenarios(rank, world_size, scenarios):
    """Each scenario on this rank: ``(baseline, with the pass)``, or, for a planted plan mismatch, the error's text.
    The scenarios differ only in the pass's options, so one run without the pass is every scenario's baseline.
    Seams are injected into their scenario's pass only."""
    from dataclasses import replace

    baseline = train(rank, world_size, RunConfig(**BASE, use_pass=False))
    out = {}
    for name, plant, cfg in scenarios:
        if plant == "measured":
            cfg = replace(cfg, seams={"device_probe": _planted_probe(rank)})
        if plant == "mismatch":  # planner.decide asks the injected chooser
            cfg = replace(cfg, seams={"chooser": _drop_last_bucket_on_the_last_rank(rank, world_size)})
        out[name] = (baseline, train(rank, world_size, cfg))
    return out


TWO_RANKS = (
    ("measured", "measured", RunConfig(**BASE, options={"min_bytes": 0})),
    ("peak", None, RunConfig(**BASE, options={"min_bytes": 0, "policy": "peak"},
                             rank_options=({"loss_bytes": 0}, {"loss_bytes": 100_000}))),
    ("budget", None, RunConfig(**BASE, options={"min_bytes": 0, "policy": "budget", "optimizer_states": 0}, rank_options=(
        {"resident_bytes": 0, "budget_bytes": 79_000}, {"resident_bytes": 800, "budget_bytes": 79_500}))),
    ("mismatch", "mismatch", RunConfig(**BASE, options={"min_bytes": 0, "bucket_bytes": 0})),
)
THREE_RANKS = (
    ("resident", None, RunConfig(**BASE, options={"min_bytes": 0},
                                 rank_options=({"resident_bytes": 0}, {"resident_bytes": MB200}, {}))),
    ("mismatch", "mismatch", RunConfig(**BASE, options={"min_bytes": 0, "bucket_bytes": 0})),
)


def _run(rank_pools, world_size, scenarios):
    per_rank = rank_pools.run(run_scenarios, world_size, scenarios, timeout_s=900)
    return {name: [r[name] for r in per_rank] for name, _, _ in scenarios}


@pytest.fixture(scope="module")
def two_ranks(rank_pools):
    return _run(rank_pools, 2, TWO_RANKS)


@pytest.fixture(scope="module")
def three_ranks(rank_pools):
    return _run(rank_pools, 3, THREE_RANKS)


def _same_plan_and_exact(results):
    """Bitwise equal to the run without the pass with non-zero gradients, on every rank; the same buckets and shard
    ops on every rank. Returns the plans."""
    plans = []
    for rank, (base, shard) in enumerate(results):
        assert mismatches(base, shard) == [], f"rank {rank}"
        assert all(g.abs().sum() > 0 for grads in shard.grads for g in grads.values()), "a gradient is zero"
        plans.append(shard.plans[0])
    assert plans[0].buckets and all(p.buckets == plans[0].buckets for p in plans)
    assert all(collectives(p, verify=False) == collectives(plans[0], verify=False) for p in plans)
    assert not torch.equal(results[0][0].losses[0], results[1][0].losses[0])  # the ranks saw different data
    return plans


def _agreed(plan, name):
    (value,) = [(a.value, a.own) for a in plan.agreed if a.name == name]
    return value


def test_agree_rank_dependent_resident_bytes(three_ranks):
    """Rank 0 gives 0 B, rank 1 200 MB, rank 2 nothing (on the CPU: not counted): every rank plans with 200 MB, which
    keeps each bucket's shard in a shard op of its own (with 0 B, the first two would share one)."""
    plans = _same_plan_and_exact(three_ranks["resident"])
    assert [b.shard_op for b in plans[0].buckets] == [0, 1, 2]
    assert [_agreed(p, "resident at the call") for p in plans] == [(MB200, 0), (MB200, MB200), (MB200, 0)]
    assert plans[2].terms[0].source == AGREED and plans[1].terms[0].source == GIVEN
    table = plan_text(plans[0])
    assert "agreed over 3 ranks before planning" in table and "209,715,200   0" in table


def test_agree_rank_dependent_measured_memory(two_ranks):
    """Rank 1's device holds 200 MB more while compiling, and a larger workspace (planted: nothing is measured on the
    CPU): both ranks plan with rank 1's figures."""
    plans = _same_plan_and_exact(two_ranks["measured"])
    assert [b.shard_op for b in plans[0].buckets] == [0, 1, 2]
    resident = [_agreed(p, "resident at the call") for p in plans]
    assert resident[0][0] == resident[1][0] == resident[1][1] > MB200 - 20_000 and resident[0][1] == 0
    assert [_agreed(p, "persistent workspaces") for p in plans] == [(2048, 1024), (2048, 2048)]
    assert [t.source for t in plans[0].terms if t.name in ("resident at the call", "persistent workspaces")] == [AGREED] * 2
    assert [t.source for t in plans[1].terms if t.name in ("resident at the call", "persistent workspaces")] == [MEASURED] * 2
    # the workspace rank 1 could not force is its own unknown term; the ranks still agreed and planned alike
    unknown = "TransformerEngine GEMM workspace"
    assert [unknown in [t.name for t in p.left_out] for p in plans] == [False, True]


def test_agree_rank_dependent_terms_under_policy_peak(two_ranks):
    """loss_bytes 0 on rank 0, 100,000 on rank 1: with the larger loss at the backward's start, all three weight
    copies lower the predicted peak, so both ranks shard all three."""
    plans = _same_plan_and_exact(two_ranks["peak"])
    assert [len(p.sharded) for p in plans] == [3, 3]
    assert [_agreed(p, "loss") for p in plans] == [(100_000, 0), (100_000, 100_000)]


def test_agree_rank_dependent_terms_and_budget_under_policy_budget(two_ranks):
    """Rank 0: resident 0 B, budget 79,000 B; rank 1: 800 B and 79,500 B. Alone each would shard one tensor; both plan
    for 800 B under 79,000 B and shard two."""
    plans = _same_plan_and_exact(two_ranks["budget"])
    assert [len(p.sharded) for p in plans] == [2, 2]
    assert all(p.peak_bytes_after <= 79_000 < p.peak_bytes_before for p in plans)
    assert [_agreed(p, "budget_bytes") for p in plans] == [(79_000, 79_000), (79_000, 79_500)]
    assert [_agreed(p, "resident at the call") for p in plans] == [(800, 0), (800, 800)]


@pytest.mark.parametrize("world", ["two_ranks", "three_ranks"])
def test_ranks_that_plan_different_layouts_all_realize_rank_0s(world, request):
    """The last rank's plan loses its last bucket after agreement (planted, as a rank whose program differs would):
    the ranks see that their layouts differ while compiling the first call, before any shard collective ran, and
    every rank realizes rank 0's; the runs are bitwise those without the pass."""
    results = request.getfixturevalue(world)["mismatch"]
    plans = _same_plan_and_exact(results)
    assert len(plans[0].buckets) == 3  # rank 0's, on the last rank too
    assert all(any("planned different layouts: rank 0's layout on every rank" in n for n in p.notes) for p in plans)
