"""Compaction options: storages kept alive from forward to backward only by saved views smaller than them (LitGPT's
``v`` holds all of ``qkv``). A compact copy of each view, made after the storage's last forward use, frees the rest. A
storage qualifies unless one of its tensors is a forward input or output, a TransformerEngine tensor or excluded (a
sharding candidate); the planner chooses."""

from __future__ import annotations

import networkx as nx
from thunder.core.proxies import TensorProxy

from thunder_fp8shard.analysis.candidates import TE_FLOAT8, Candidate
from thunder_fp8shard.analysis.liveness import held_to, last_uses, uses, view_graph
from thunder_fp8shard.plan import Compaction
from thunder_fp8shard.analysis.saved import tensor_nbytes


def program_compactions(facts, candidates: list[Candidate]) -> tuple[Compaction, ...]:
    """The compaction options of a program (``facts``: its ``ProgramFacts``) in order of allocation, none taken; a
    storage holding a model input or output, or one of ``candidates`` that is a TE tensor, is none."""
    excluded = facts.model_io | {c.name for c in candidates if c.kind == TE_FLOAT8}
    graph, lives, life_of = facts.graph, facts.lives, facts.life_of
    by_storage: dict[str, dict[str, TensorProxy]] = {}
    for p in facts.saved:
        if p.name in life_of:
            by_storage.setdefault(life_of[p.name].name, {})[p.name] = p
    views, last_use = view_graph(graph), last_uses(graph)
    backward_start = graph.graph["backward_start"]
    options = []
    for name in (n for n in lives if n in by_storage):
        life, members = lives[name], list(by_storage[name].values())
        nbytes = tuple(tensor_nbytes(p) for p in members)
        if life.nbytes <= sum(nbytes) or excluded.intersection(life.members):
            continue
        compact_at = max([life.start, *(u for u in uses(graph, life.members) if u < backward_start)])
        if compact_at >= backward_start:
            continue
        ends = tuple(held_to(graph, {p.name, *nx.descendants(views, p.name)}, last_use) for p in members)
        options.append(Compaction(
            storage=name, members=tuple(p.name for p in members), shapes=tuple(tuple(int(s) for s in p.shape)
                                                                             for p in members),
            dtypes=tuple(str(p.dtype).removeprefix("thunder.dtypes.") for p in members), member_nbytes=nbytes,
            storage_nbytes=life.nbytes, compact_at=compact_at, ends=ends,
        ))
    return tuple(options)
