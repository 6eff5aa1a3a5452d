"""Every rank compiles the same plan (thunder_fp8shard.agreement): the plan's per-rank inputs are agreed before
planning, and a plan whose collectives differ between ranks raises the same error on every rank before any of them
runs.

The multi-rank scenarios of one world size run in one set of processes (one process start per rank, and one run
without the pass, for all of them); each test reads its own scenario. In every scenario the ranks' own inputs would
give different buckets (toy-model plans measured with uniform inputs: resident 0 B groups the weight copies' shards
into 2 shard ops, 200 MB into 3; budget 79,000 B with resident 0 B shards one tensor, with 800 B two; peak with loss
0 B shards two, with 100,000 B three): without the agreement gloo aborts on a collective mismatch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from thunder_fp8shard.agreement import ABSENT, MAX_TERMS, collectives, digest, encode, mismatch_message, settle
from thunder_fp8shard.plan import AGREED, GIVEN, MEASURED, MODELLED, NOT_COUNTED, UNKNOWN, Bucket, Decision, MemoryTerm, ShardPlan
from thunder_fp8shard.testing.harness import run_on_ranks
from thunder_fp8shard.testing.reference_run import RunConfig, mismatches, train, train_with_and_without

WIDTHS = (25, 61, 47, 7)  # the weight copies hold 1,525, 2,867 and 329 bytes (min_bytes=0 shards them)
MB200 = 200 << 20
BASE = dict(widths=WIDTHS, batch_sizes=(3,), no_grad_call=False)


# ---- pure parts: what is agreed, what is compared --------------------------------------------------------------------

LAST = 9


def _terms(resident: int | None, loss: int, workspaces: int) -> list[MemoryTerm]:
    return [
        MemoryTerm("resident at the call", GIVEN, "resident_bytes", ((0, LAST, resident),)) if resident is not None
        else MemoryTerm("resident at the call", NOT_COUNTED, "CPU"),
        MemoryTerm("inputs held by the caller", MODELLED, "", ((3, LAST, 64), (5, LAST, 32))),
        MemoryTerm("loss", GIVEN, "loss_bytes", ((6, 6, loss),)),
        MemoryTerm("persistent workspaces", MEASURED, "", ((0, LAST, workspaces),)),
    ]


def _agree_in_process(ranks):
    """What ``agree`` gives each rank: settle on the element-wise MAX of every rank's slots."""
    reduced = [max(column) for column in zip(*(encode(terms, budget) for terms, budget in ranks))]
    return [settle(terms, budget, reduced) for terms, budget in ranks]


def test_agree_plans_every_rank_with_the_largest_terms_and_the_smallest_budget():
    ranks = [(_terms(0, 100, 8), 5000), (_terms(MB200, 10, 8), 7000), (_terms(None, 50, 16), 6000)]
    agreed = _agree_in_process(ranks)
    spans = [[t.spans for t in a.terms] for a in agreed]
    assert spans[0] == spans[1] == spans[2] == [
        ((0, LAST, MB200),),  # rank 2 counted nothing: it gets the span too
        ((3, LAST, 64), (5, LAST, 32)),  # several spans: modelled from the program, kept
        ((6, 6, 100),),
        ((0, LAST, 16),),
    ]
    assert [a.budget_bytes for a in agreed] == [5000] * 3
    # the plan lists what was agreed against this rank's own; a term replaced by another rank's value says so
    rows = {r: [(v.name, v.value, v.own, v.rule) for v in a.values] for r, a in enumerate(agreed)}
    assert rows[2] == [("resident at the call", MB200, 0, "largest"), ("loss", 100, 50, "largest"),
                       ("persistent workspaces", 16, 16, "largest"), ("budget_bytes", 5000, 6000, "smallest")]
    assert [t.source for t in agreed[1].terms] == [GIVEN, MODELLED, AGREED, AGREED]
    assert "10 B on this rank" in agreed[1].terms[2].how


def test_agree_keeps_a_ranks_own_values_when_every_rank_has_them():
    terms = _terms(MB200, 100, 8)
    (one,) = _agree_in_process([(terms, None)])
    assert one.terms == tuple(terms) and one.budget_bytes is None
    assert encode(terms, None)[-1] == ABSENT


def test_a_workspace_one_rank_could_not_force_leaves_every_ranks_slots_the_same_length():
    """The unknown term of a workspace a rank could not force (a CUDA out-of-memory while forcing it, say) exists on
    that rank alone: the slots still have one length on every rank, and every rank plans with the same bytes."""
    unknown = MemoryTerm("TransformerEngine GEMM workspace", UNKNOWN, "could not be forced at compilation (OOM)")
    ranks = [(_terms(0, 100, 8), None), ([*_terms(0, 100, 16), unknown], None)]
    assert len(encode(*ranks[0])) == len(encode(*ranks[1])) == 3 * MAX_TERMS + 1
    agreed = _agree_in_process(ranks)
    assert [t.spans for t in agreed[0].terms] == [t.spans for t in agreed[1].terms[:-1]]
    assert agreed[1].terms[-1] == unknown and len(agreed[0].terms) == 4
    with pytest.raises(ValueError, match="more than the 16"):
        encode([unknown] * (MAX_TERMS + 1), None)


def _decision(name, nbytes):
    return Decision(name, (nbytes,), "float8_e4m3fn", "float8", nbytes, True, True, "identical", -(-nbytes // 2))


def _plan(buckets):
    decisions = [_decision("a", 1525), _decision("b", 2867), _decision("c", 329)]
    return ShardPlan(2, "slice", "all", 1, decisions, 0, 0, buckets=buckets, comm="shared")


BUCKETS = [
    Bucket(0, ("a",), 1525, 763, 1526, shard_at=10, gather_at=20, first_use=22, shard_op=0, shard_offset=0),
    Bucket(1, ("b",), 2867, 1434, 2868, shard_at=12, gather_at=22, first_use=30, shard_op=0, shard_offset=763),
    Bucket(2, ("c",), 329, 165, 330, shard_at=14, gather_at=30, first_use=40, shard_op=1, shard_offset=0),
]


def test_plan_mismatch_message_names_the_differing_fields_and_values():
    same = collectives(_plan(BUCKETS), verify=False)
    assert digest(same) == digest(collectives(_plan(list(BUCKETS)), verify=False))
    fields = dict(same)
    assert fields["shard ops"] == "2" and fields["gather order"] == "0, 1, 2"
    assert fields["bucket 1"] == ("bytes 763-2,197 of shard op 0, members of 2,867 B, 2,868 B gathered, issued at step "
                                  "22, waited before step 30")
    merged = [BUCKETS[0], BUCKETS[1], Bucket(2, ("c",), 329, 165, 330, 14, 30, 40, shard_op=0, shard_offset=2197)]
    other = collectives(_plan(merged), verify=False)
    assert digest(other) != digest(same)
    message = mismatch_message([same, same, other], [0, 1, 2])
    assert "rank 1" not in message  # rank 1 planned what rank 0 did
    assert "rank 2 differs from rank 0 in shard ops: rank 0 '2', rank 2 '1'" in message
    assert ("shard op 0: rank 0 '2,197 B a rank after step 12, keeping bucket(s) 0, 1', rank 2 '2,362 B a rank after "
            "step 14, keeping bucket(s) 0, 1, 2'") in message
    assert "shard op 1: rank 0 '165 B a rank after step 14, keeping bucket(s) 2', rank 2 '(none)'" in message
    assert message.endswith("; and 1 more field(s). The memory terms and budget_bytes are agreed across the ranks "
                            "before planning; other options must be the same on every rank.")  # bucket 2 moved
    assert collectives(_plan(BUCKETS), verify=True) != same  # verify all-gathers a digest per member


FAKE_GROUP = textwrap.dedent("""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    import test_agreement as t
    from thunder_fp8shard.agreement import agree, check

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=3)
    terms = t._terms(7, 100, 8)
    a = agree(terms, 5000, dist.group.WORLD)
    assert a.terms == tuple(terms) and a.budget_bytes == 5000, a
    assert [(v.value, v.own) for v in a.values] == [(7, 7), (100, 100), (8, 8), (5000, 5000)], a.values
    check(t._plan(t.BUCKETS), dist.group.WORLD, verify=False)  # every digest is this rank's: no error
    print("ok")
""")


def test_agree_and_plan_check_under_the_fake_process_group_keep_this_ranks_own():
    """torch's fake process group (benchmarks simulate N ranks in one process with it) returns at once: the agreed
    values are this rank's own and the plan check passes."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    done = subprocess.run([sys.executable, "-c", FAKE_GROUP], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


# ---- on real gloo processes ------------------------------------------------------------------------------------------


def _planted_measure(rank):
    """What a rank's device would say while compiling: rank r holds r x 200 MB and a cuBLAS workspace of 1 << (10 + r)
    bytes, and every rank but the first could not force a TE GEMM workspace (one more memory term there: unknown);
    on the CPU nothing is measured, so the test plants it where the transform reads it."""
    from thunder_fp8shard.device_memory import DeviceMemory

    def measure(trace, *, transformer_engine, cublas=True):
        failed = (("TransformerEngine GEMM", "planted: CUDA out of memory"),) if rank else ()
        return DeviceMemory("cpu", rank * MB200, (("cuBLAS", 1 << (10 + rank)),), failed)

    return measure


def _drop_last_bucket_on_the_last_rank(rank, world_size, choose):
    """A plan that differs after agreement: the last rank leaves out its last bucket."""

    def perturbed(*args, **kwargs):
        from dataclasses import replace

        choice = choose(*args, **kwargs)
        return replace(choice, buckets=choice.buckets[:-1]) if rank == world_size - 1 else choice

    return perturbed


def run_scenarios(rank, world_size, scenarios):
    """Each scenario on this rank: ``(baseline, with the pass)``, or, for a planted plan mismatch, the error's text.
    The scenarios differ only in the pass's options, so one run without the pass is every scenario's baseline.
    Seams are planted for their scenario only."""
    import thunder_fp8shard.planner as planner
    import thunder_fp8shard.transform as transform

    baseline = train(rank, world_size, RunConfig(**BASE, use_pass=False))
    out = {}
    for name, plant, cfg in scenarios:
        saved = transform.measure, planner.choose
        try:
            if plant == "measured":
                transform.measure = _planted_measure(rank)
            if plant == "mismatch":  # make_plan asks planner.choose
                planner.choose = _drop_last_bucket_on_the_last_rank(rank, world_size, planner.choose)
                try:
                    train(rank, world_size, cfg)
                    out[name] = "no error"
                except RuntimeError as e:
                    out[name] = str(e)
            else:
                out[name] = (baseline, train(rank, world_size, cfg))
        finally:
            transform.measure, planner.choose = saved
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


def _run(world_size, scenarios):
    per_rank = run_on_ranks(run_scenarios, world_size, scenarios, timeout_s=900)
    return {name: [r[name] for r in per_rank] for name, _, _ in scenarios}


@pytest.fixture(scope="module")
def two_ranks():
    return _run(2, TWO_RANKS)


@pytest.fixture(scope="module")
def three_ranks():
    return _run(3, THREE_RANKS)


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
    table = str(plans[0])
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
def test_plan_mismatch_raises_the_same_error_on_every_rank(world, request):
    """The last rank's plan loses its last bucket after agreement (planted): every rank raises the same error naming
    the bucket count and the missing bucket, while compiling the first call, i.e. before any shard collective ran,
    and no rank hangs or aborts."""
    errors = request.getfixturevalue(world)["mismatch"]
    n = len(errors)
    assert all(e == errors[0] for e in errors), errors
    assert errors[0].startswith("ShardIntermediates: the ranks planned different collectives for this compilation")
    last = n - 1
    assert f"rank {last} differs from rank 0 in shard ops: rank 0 '3', rank {last} '2'; shard op 2: " in errors[0]
    assert f"; buckets: rank 0 '3', rank {last} '2'; and 2 more field(s)" in errors[0]  # bucket 2, the gather order
