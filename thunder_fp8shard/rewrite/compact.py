"""Compaction: saved views smaller than their storage replaced by compact copies after its last forward use
(:mod:`thunder_fp8shard.analysis.compaction`). The planner decides it with the shards and the shard rewrite makes the
copies (:mod:`thunder_fp8shard.rewrite.shard`)."""

from __future__ import annotations

from dataclasses import replace

from thunder_fp8shard.analysis.compaction import program_compactions
from thunder_fp8shard.plan import Compaction
from thunder_fp8shard.rewrite.shape import Effect, Program, Rewrite


def sites(program: Program) -> tuple[Compaction, ...]:
    """The options, none taken; a storage holding a TE tensor or a model input or output is none."""
    return program_compactions(program.facts, program.sites["shard"])


def effect(program: Program, effect: Effect) -> Effect:
    return replace(effect, compactions=program.sites["compaction"])


COMPACTION = Rewrite("compaction", sites, effect)  # decided by the planner with the shards, made by the shard rewrite
