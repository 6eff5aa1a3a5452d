"""A rewrite defined here, outside the package, plugged in through the public protocol (issue #56 item 1): the
package's rewrites with its compaction replaced by this file's own, given as ``ShardIntermediates().inject(
rewrites=...)``. Its rule is its own: it offers the compaction of a saved view only where the view's storage is at
least twice the view. The planner weighs that item with the shards in one choice, the shard rewrite makes its copy,
and the model trains bitwise exactly on real gloo ranks (a one-block LitGPT-style model: its saved ``v`` keeps all of
``qkv`` alive)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

import thunder_fp8shard
from thunder_fp8shard.analysis.compaction import program_compactions
from thunder_fp8shard.pipeline import REWRITES
from thunder_fp8shard.rewrite.shape import Effect, Program, Rewrite
from thunder_fp8shard.testing.reference_run import RunConfig, mismatches, train_with_and_without

pytestmark = pytest.mark.multirank

NAME = "halved_views"


def _sites(program: Program) -> tuple:
    """Views at most half their storage, of storages holding no model input or output."""
    return tuple(c for c in program_compactions(program.facts, []) if 2 * sum(c.member_nbytes) <= c.storage_nbytes)


def _effect(program: Program, effect: Effect) -> Effect:
    return replace(effect, compactions=(*effect.compactions, *program.sites[NAME]))


HALVED_VIEWS = Rewrite(NAME, _sites, _effect)
PLUGGED = tuple(HALVED_VIEWS if r.name == "compaction" else r for r in REWRITES)
WITHOUT = tuple(r for r in REWRITES if r.name != "compaction")
LLAMA = dict(model="llama", batch_sizes=((2, 16), (2, 12), (2, 16)), no_grad_call=False,
             options={"min_bytes": 0})


def test_a_rewrite_defined_outside_the_package_is_weighed_with_the_shards_and_trains_exactly(on_ranks):
    results = on_ranks(train_with_and_without, 2, RunConfig(**LLAMA, seams={"rewrites": PLUGGED}))
    for rank, (base, shard) in enumerate(results):
        assert mismatches(base, shard) == [], f"rank {rank}"
        assert all(g.abs().sum() > 0 for step in shard.grads for g in step.values()), "a zero gradient: the check is void"
        plan = shard.plans[0]
        taken = [c for c in plan.compactions if c.compacted]
        assert len(taken) == 1 and 2 * sum(taken[0].member_nbytes) <= taken[0].storage_nbytes, plan.compactions
        assert any(d.sharded for d in plan.decisions), "the choice has shards beside the compaction"
        assert plan.peak_bytes_after < plan.peak_bytes_before
        assert plan.saved_bytes_after < plan.saved_bytes_before
        assert plan.operator_calls.get("fp8shard_shard", 0) > 0
    # without it (and without the package's compaction) nothing is compacted: the item was this file's
    alone = on_ranks(train_with_and_without, 2, RunConfig(**LLAMA, seams={"rewrites": WITHOUT}))
    assert all(not any(c.compacted for c in shard.plans[0].compactions) for _, shard in alone)
    package = Path(thunder_fp8shard.__file__).parent
    assert not [p for p in package.rglob("*.py") if NAME in p.read_text() or "HALVED_VIEWS" in p.read_text()]
