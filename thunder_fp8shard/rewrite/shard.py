"""The shard rewrite: each replicated saved tensor kept as this rank's 1/k shard from its last forward use and
all-gathered back before its first backward use. It turns the planner's one choice (``Program.choice``: its shards and
the compactions weighed with them) into the plan's fields, and its trace rewrite makes the compact copies in the same
pass."""

from __future__ import annotations

from dataclasses import replace

from thunder_fp8shard.analysis.candidates import find_candidates
from thunder_fp8shard.plan import ShardPlan
from thunder_fp8shard.planning.planner import make_plan
from thunder_fp8shard.rewrite.shape import Effect, Program, Rewrite, Rewritten
from thunder_fp8shard.rewrite.traces import requests, rewrite_backward, rewrite_forward


def sites(program: Program) -> tuple:
    """The candidates: every saved tensor the ``candidates`` option names (``"auto"``: all, narrowed by own shards);
    none without a distributed setup."""
    if program.setup is None:
        return ()
    o, facts = program.options, program.facts
    return tuple(find_candidates(facts.saved, "all" if o.candidates == "auto" else o.candidates, facts.te_names))


def effect(program: Program, effect: Effect) -> Effect:
    return replace(effect, candidates=program.sites["shard"])


def decide(program: Program) -> tuple[dict, tuple[str, ...]]:
    return make_plan(program.analysis, program.options, program.choice, program.agreed), ()


def apply(program: Program, plan: ShardPlan, rewritten: Rewritten) -> Rewritten:
    o, k, name = program.options, program.k, program.name
    shard_ops, compactions = requests(plan, program.facts)
    n = sum(len(r.members) for op in shard_ops for r in op.buckets)
    forward = rewrite_forward(
        program.facts, shard_ops, group=program.group, k=k, method=o.method, verify=o.verify, compactions=compactions,
        provenance=f"{name}: {n} saved tensors kept as 1/{k} shards of {len(plan.buckets)} "
        f"bucket(s) by {len(shard_ops)} shard op(s) ({o.method}), {len(compactions)} compaction(s)",
    )
    backward, _ = rewrite_backward(
        rewritten.backward, forward, group=program.group,
        provenance=f"{name}: {len(plan.buckets)} bucket(s) all-gathered (prefetch {o.prefetch})",
    )
    return Rewritten(forward, backward)


SHARD = Rewrite("shard", sites, effect, decide, apply)
