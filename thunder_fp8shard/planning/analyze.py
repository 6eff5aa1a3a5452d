"""What a compilation's traces say before anything is agreed or chosen: candidates, the memory model, the replication
verdicts and the saved tensors, gathered by one pure function, :func:`analyze`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from thunder_fp8shard.analysis.candidates import (
    AUTO_INPUT_SHARD_MIN_BYTES, TENSOR, Candidate, find_candidates, saved_bytes_by_dtype,
)
from thunder_fp8shard.analysis.own_shards import own_shards
from thunder_fp8shard.analysis.program import ProgramFacts
from thunder_fp8shard.analysis.replication import Replication, analyze_replication
from thunder_fp8shard.memory.model import MemoryModel, gathers_hold_scratch, memory_model
from thunder_fp8shard.options import ShardOptions
from thunder_fp8shard.plan import MemoryTerm


@dataclass(frozen=True)
class Analysis:
    candidates: tuple[Candidate, ...]  # none without a distributed setup
    model: MemoryModel
    replication: Replication | None  # over the setup's whole group
    saved_names: frozenset[str]
    model_io: frozenset[str]  # the caller keeps them alive
    saved_by_dtype: dict[str, int] = dataclasses.field(default_factory=dict)  # by dtype
    # candidate -> the forward input that is its shard (analysis.own_shards)
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def with_terms(self, terms: Sequence[MemoryTerm]) -> Analysis:
        """The same analysis with the memory terms every rank agreed on."""
        return dataclasses.replace(self, model=dataclasses.replace(self.model, terms=tuple(terms)))


def analyze(facts: ProgramFacts, options: ShardOptions, setup, device, extra_terms: Sequence[MemoryTerm] = (),
            replication_analysis=analyze_replication, resized: Mapping[str, int] | None = None,
            shard_ranks: tuple[int, ...] = ()) -> Analysis:
    """The analysis of ``facts``. ``setup``: None for compaction alone; ``device``: read while compiling (None on the
    CPU); ``extra_terms``: measured at run time; ``resized``: storages the forward rewrite resizes; ``shard_ranks``: the
    shard group in order."""
    auto = options.candidates == "auto"
    candidates = find_candidates(facts.saved, "all" if auto else options.candidates, facts.te_names) if (
        setup is not None) else []
    sources = {}
    if setup is not None and len(shard_ranks) > 1:
        inputs = [p for p in facts.inputs if p.name not in facts.saved_names]  # one saved, counted once
        names = [c.name for c in candidates]
        sources = {n: p.name for n, p in own_shards(facts.forward, names, inputs, ranks=shard_ranks).items()}
    # FP8 copies, plus tensors whose shards are inputs already where worth it, unless the setup keeps them gathered on
    # purpose (ZeRO-2)
    if auto:
        inputs_too = setup is not None and not setup.keeps_gathered
        candidates = [c for c in candidates if c.kind != TENSOR or (inputs_too and c.name in sources and
                                                                     c.payload_bytes >= AUTO_INPUT_SHARD_MIN_BYTES)]
        sources = {n: s for n, s in sources.items() if n in {c.name for c in candidates}}
    model = memory_model(facts, candidates, options=options, device=device,
                         gather_scratch=setup is not None and gathers_hold_scratch(setup.group, facts.device),
                         resized=resized)
    if extra_terms:
        model = dataclasses.replace(model, terms=(*model.terms, *extra_terms))
    replication = None
    if setup is not None:
        fw = facts.forward
        replication = replication_analysis(fw, setup.group, setup.replicated_inputs(fw), setup.input_reasons(fw))
    return Analysis(tuple(candidates), model, replication, facts.saved_names, facts.model_io,
                    saved_bytes_by_dtype(facts.saved, facts.te_names), sources)
