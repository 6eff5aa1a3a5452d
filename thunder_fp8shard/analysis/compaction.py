"""Compaction of saved views: which storages only saved views smaller than them keep alive from forward to backward,
and where a compact copy of each view would go. Pure functions over the joint program's graph and storage lives
(:mod:`thunder_fp8shard.analysis.liveness`).

A saved tensor that views a larger storage keeps all of it alive until its backward use: autograd saves the view,
and a view holds its whole storage. Under Thunder's benchmark executors LitGPT's ``v`` (a third of ``qkv``, a view
of it out of a torch.compile region: :mod:`thunder_fp8shard.analysis.aliasing`) keeps each layer's 96 MiB ``qkv`` alive for
its 32 MiB. Replacing each saved view of such a storage by a compact copy, made right after the last forward use
of any tensor viewing the storage, frees the rest of it. The copy is rank-local (no communication) and exact: it
holds the view's values, in the view's dimension order (:func:`thunder_fp8shard.runtime.ops.compact`).

A storage is a compaction option when all of its saved tensors together hold fewer bytes than it, and none of its
tensors is a forward input or output (the caller holds those anyway), a TransformerEngine quantized tensor (not a
plain tensor to copy) or excluded by the caller (a sharding candidate: sharding it frees the storage already).
Whether an option is taken is the planner's choice (:func:`thunder_fp8shard.planning.planner.choose`), and which operator
call makes its copies, possibly later than its step, the grouping's (:func:`thunder_fp8shard.planning.grouping.place_compactions`).
"""

from __future__ import annotations

from collections.abc import Mapping

import networkx as nx
from thunder.core.proxies import TensorProxy

from thunder_fp8shard.analysis.liveness import Life, held_to, last_uses, storage_of, uses, view_graph
from thunder_fp8shard.plan import Compaction
from thunder_fp8shard.analysis.saved import tensor_nbytes


def compaction_options(
    graph: nx.DiGraph, lives: Mapping[str, Life], saved: list[TensorProxy], excluded: set[str],
    life_of: Mapping[str, Life] | None = None,
) -> list[Compaction]:
    """The compaction options of the program whose joint graph and lives are given (``saved``: the forward's saved
    tensors; ``excluded``: names whose storage is not to be compacted; ``life_of``: each tensor's storage, where the
    caller has it), in order of the storages' allocation, each not yet taken."""
    life_of = storage_of(lives) if life_of is None else life_of
    by_storage: dict[str, dict[str, TensorProxy]] = {}
    for p in saved:
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
    return options
