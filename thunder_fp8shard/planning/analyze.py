"""What a compilation's traces say before anything is agreed across the ranks or chosen: the candidates (with their
payload sizes), the memory model of the joint program (with the compaction options and the memory the step runs
in), the replication verdicts over the setup's group, the saved tensors and the forward's inputs and outputs. One
pure function, :func:`analyze`, over the program's facts (:mod:`thunder_fp8shard.analysis.program`), the options, the
setup and what the device said while compiling.
"""

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
    candidates: tuple[Candidate, ...]  # none without a distributed setup (compaction alone)
    model: MemoryModel
    replication: Replication | None  # over the setup's whole group; None without a distributed setup
    saved_names: frozenset[str]
    model_io: frozenset[str]  # the forward's inputs and outputs: the caller keeps them alive
    saved_by_dtype: dict[str, int] = dataclasses.field(default_factory=dict)  # saved tensors' bytes by dtype
    # candidates whose shard is a forward input (analysis.own_shards), by name: the input's name
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def with_terms(self, terms: Sequence[MemoryTerm]) -> Analysis:
        """The same analysis with the memory terms every rank agreed on."""
        return dataclasses.replace(self, model=dataclasses.replace(self.model, terms=tuple(terms)))


def analyze(facts: ProgramFacts, options: ShardOptions, setup, device, extra_terms: Sequence[MemoryTerm] = (),
            replication_analysis=analyze_replication, resized: Mapping[str, int] | None = None,
            shard_ranks: tuple[int, ...] = ()) -> Analysis:
    """The analysis of the program ``facts`` describes (:func:`~thunder_fp8shard.analysis.program.program_facts`).
    ``setup``: the distributed setup (:class:`~thunder_fp8shard.distributed.integrations.Integration`; None:
    compaction alone); ``device``: the :class:`~thunder_fp8shard.memory.device.DeviceMemory` read while compiling
    (None on the CPU); ``extra_terms``: memory terms measured at run time before (the calibration's error after a
    missed budget); ``replication_analysis``: :func:`~thunder_fp8shard.analysis.replication.analyze_replication` (a
    test injects another, see :class:`thunder_fp8shard.pipeline.Seams`); ``resized``: storages the pass's forward
    rewrite makes another size (:func:`~thunder_fp8shard.memory.model.memory_model`); ``shard_ranks``: the shard
    group's global ranks in its order (:func:`~thunder_fp8shard.analysis.own_shards.own_shards`)."""
    auto = options.candidates == "auto"
    candidates = find_candidates(facts.saved, "all" if auto else options.candidates, facts.te_names) if (
        setup is not None) else []
    sources = {}
    if setup is not None and len(shard_ranks) > 1:
        inputs = [p for p in facts.inputs if p.name not in facts.saved_names]  # one saved, counted once
        names = [c.name for c in candidates]
        sources = {n: p.name for n, p in own_shards(facts.forward, names, inputs, ranks=shard_ranks).items()}
    if auto:  # FP8 copies, and the tensors whose shards are inputs already (nothing copied), where that is worth it
        # and the setup does not keep them gathered on purpose (ZeRO-2)
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
