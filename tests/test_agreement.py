"""Every rank compiles the same plan (thunder_fp8shard.distributed.agreement), its pure parts in this process: what the ranks'
memory terms and budget are agreed to (the element-wise maximum of every rank's slots, one length on every rank),
the digest of a plan's collectives and the message naming what differs; and agree/check under torch's fake process
group. On real gloo ranks: tests/test_agreement_on_ranks.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from thunder_fp8shard.distributed.agreement import ABSENT, MAX_TERMS, collectives, digest, encode, mismatch_message, settle
from thunder_fp8shard.plan import AGREED, GIVEN, MEASURED, MODELLED, NOT_COUNTED, UNKNOWN, Bucket, Decision, MemoryTerm, ShardPlan

MB200 = 200 << 20


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
    return ShardPlan.of(2, "slice", "all", 1, decisions, 0, 0, buckets=buckets, comm="shared")


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
    assert message.endswith("; and 1 more field(s). Neither rank 0's layout nor sharding nothing makes them the same: "
                            "the ranks' programs differ beyond the pass (their own code paths?); the options must be "
                            "the same on every rank.")  # bucket 2 moved
    assert collectives(_plan(BUCKETS), verify=True) != same  # verify all-gathers a digest per member


FAKE_GROUP = textwrap.dedent("""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    import test_agreement as t
    from thunder_fp8shard.distributed.agreement import agree, differing
    from thunder_fp8shard.distributed.layout import Layout

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=3)
    terms = t._terms(7, 100, 8)
    a = agree(terms, 5000, dist.group.WORLD)
    assert a.terms == tuple(terms) and a.budget_bytes == 5000, a
    assert [(v.value, v.own) for v in a.values] == [(7, 7), (100, 100), (8, 8), (5000, 5000)], a.values
    assert differing(Layout(signature=("x",)), dist.group.WORLD) is None  # every digest is this rank's
    print("ok")
""")


@pytest.mark.simulated
def test_agree_and_plan_check_under_the_fake_process_group_keep_this_ranks_own():
    """torch's fake process group (benchmarks simulate N ranks in one process with it) returns at once: the agreed
    values are this rank's own and the plan check passes."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    done = subprocess.run([sys.executable, "-c", FAKE_GROUP], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
