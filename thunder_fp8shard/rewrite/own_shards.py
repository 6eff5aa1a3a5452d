"""Own shards: a saved all-gathered weight whose shard is this rank's parameter shard, a forward input
(:mod:`thunder_fp8shard.analysis.own_shards`). Under ``candidates="auto"`` it makes such a tensor a candidate; the
planner marks it (``Decision.shard_source``) and the shard rewrite gathers its bucket from the inputs."""

from __future__ import annotations

from dataclasses import replace

from thunder_fp8shard.analysis.candidates import AUTO_INPUT_SHARD_MIN_BYTES, TENSOR
from thunder_fp8shard.analysis.own_shards import own_shards
from thunder_fp8shard.rewrite.shape import Effect, Program, Rewrite


def sites(program: Program) -> dict[str, str]:
    """Candidate -> the forward input that is its shard."""
    if program.setup is None or len(program.shard_ranks) <= 1:
        return {}
    facts = program.facts
    inputs = [p for p in facts.inputs if p.name not in facts.saved_names]  # one saved, counted once
    names = [c.name for c in program.sites["shard"]]
    return {n: p.name for n, p in own_shards(facts, names, inputs, ranks=program.shard_ranks).items()}


def effect(program: Program, effect: Effect) -> Effect:
    """Under "auto": FP8 copies, plus tensors whose shards are inputs already where worth it, unless the setup keeps
    them gathered on purpose (ZeRO-2). Under "all": every candidate, and those "auto" would consider (``defaults``)."""
    candidates, sources = effect.candidates, program.sites["own_shards"]
    inputs_too = program.setup is not None and not program.setup.keeps_gathered
    auto = tuple(c for c in candidates if c.kind != TENSOR or (
        inputs_too and c.name in sources and c.payload_bytes >= AUTO_INPUT_SHARD_MIN_BYTES))
    if program.options.candidates == "auto":
        candidates, sources = auto, {n: s for n, s in sources.items() if n in {c.name for c in auto}}
    defaults = frozenset(c.name for c in auto) if program.options.candidates == "all" else None
    return replace(effect, candidates=candidates, sources=sources, defaults=defaults)


OWN_SHARDS = Rewrite("own_shards", sites, effect)  # the planner marks them, the shard rewrite gathers them
