"""Storage lives of the joint program (the forward's bound symbols then the backward's, one ``Step`` each), as pure
functions over Thunder traces.

- Views (view ops, a future's wait, aliasing region outputs) share their input's storage, which lives as long as any
  tensor viewing it, from its allocation to its last real use (``del``, clears and return are not uses).
- Forward inputs and outputs live to the end of the forward, saved tensors into the backward, gradients to the end."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import networkx as nx
import numpy as np
from thunder.core.prims import PrimIDs
from thunder.core.proxies import FutureTensorProxy, Proxy, TensorProxy
from thunder.core.symbol import BoundSymbol, default_python_printer
from thunder.core.trace import TraceCtx

from thunder_fp8shard.analysis.aliasing import region_aliasing
from thunder_fp8shard.analysis.names import SLICE, TE_SCALE_UPDATE, WAIT
from thunder_fp8shard.analysis.saved import forward_inputs, forward_outputs, forward_saved, tensor_nbytes
from thunder_fp8shard.plan import Step, Timeline

# Ops whose outputs view their first tensor argument.
VIEW_OPS = frozenset(
    {
        "reshape", "view", "view_as", "flatten", "unflatten", "squeeze", "unsqueeze", "contiguous",
        "transpose", "permute", "movedim", "t", "expand", "expand_as", "broadcast_in_dim",
        "__getitem__", "getitem", SLICE, "narrow", "select", "diagonal",
        "split", "chunk", "tensor_split", "unbind", "shallow_copy", "bitcast", "torch_prims_reshape_impl", WAIT,
    }
)  # fmt: skip
# Ops returning their ``tokens=`` arguments unchanged (TransformerEngine's scale update)
PASS_THROUGH_TOKENS = (TE_SCALE_UPDATE,)
# not real ops, one rule for the pass: bookkeeping holds nothing alive; unpacks and checks name inputs
_UNPACKS = frozenset(p for p in PrimIDs if p.name.startswith(("UNPACK", "CHECK", "ASSERT")))
_BOOKKEEPING = frozenset({PrimIDs.DEL, PrimIDs.RETURN, PrimIDs.COMMENT})


@dataclass(frozen=True)
class Life:
    """One storage: a group of aliasing proxies, counted once, live on the steps [start, end]."""

    name: str  # the first-produced proxy of the group
    members: tuple[str, ...]  # in order of appearance
    nbytes: int
    start: int  # 0 for forward inputs
    end: int  # step of its last use, inclusive


@dataclass(frozen=True)
class ShardedStorages:
    """What sharding a bucket of saved storages does (indices are steps of the unmodified program)."""

    name: str  # e.g. "bucket3"
    lives: tuple[str, ...]  # Life names of the sharded saved storages
    shard_nbytes: int  # the 1/N shard kept between forward and backward
    gathered_nbytes: int  # the all-gathered buffer the restored tensors view
    shard_at: int  # the full storages' last forward use
    gather_at: int  # the backward all-gather's issue; the full buffer is allocated here
    first_use: int  # the first backward consumer of any member
    shard_until: int | None = None  # last step the shard is held (default ``first_use``)
    # several buckets of one shard op share one shard until the last wait; ``scratch_nbytes``: the all-gather's own
    # temporary (gloo on the CPU)
    scratch_nbytes: int = 0


def _tensors(xs: Iterable) -> list[Proxy]:
    return [x for x in xs if isinstance(x, (TensorProxy, FutureTensorProxy))]


def is_bookkeeping(bsym: BoundSymbol) -> bool:
    """``del``, return, comments and ``clear_mutable_collection``: not uses of their arguments."""
    return bsym.sym.id in _BOOKKEEPING or bsym.sym.name == "clear_mutable_collection"


def readers(body: list[BoundSymbol]) -> dict[str, list[int]]:
    """Proxy name -> the positions of the bound symbols of ``body`` reading it (bookkeeping left out), each once."""
    out: dict[str, list[int]] = {}
    for i, b in enumerate(body):
        if not is_bookkeeping(b):
            for name in dict.fromkeys(p.name for p in b.flat_proxy_args):
                out.setdefault(name, []).append(i)
    return out


def is_unpack(bsym: BoundSymbol) -> bool:
    """An unpack (or a check) of the trace's inputs: its outputs are inputs, not allocations."""
    return bsym.sym.id in _UNPACKS


def is_compute(bsym: BoundSymbol) -> bool:
    """False for bookkeeping and unpacks, which compute nothing."""
    return not (is_bookkeeping(bsym) or is_unpack(bsym))


def _joint(fw_trace: TraceCtx, bw_trace: TraceCtx | None) -> list[tuple[str, BoundSymbol]]:
    bw = bw_trace.bound_symbols if bw_trace is not None else []
    return [("forward", b) for b in fw_trace.bound_symbols] + [("backward", b) for b in bw]


def _label(bsym: BoundSymbol) -> str:
    """The printed line of ``bsym`` up to its call's "(", spelled out for common cases (printing is slow)."""
    sym = bsym.sym
    if sym.id == PrimIDs.RETURN:
        return "return"
    if not bsym.header:
        if sym.python_printer is default_python_printer:
            out = bsym.output
            if out is None or (type(out) in (tuple, list) and not out):
                return bsym.name_with_module()
            if isinstance(out, (TensorProxy, FutureTensorProxy)):
                return f"{out.name} = {bsym.name_with_module()}"
        elif sym.id == PrimIDs.DEL and all(isinstance(a, Proxy) for a in bsym.args):
            return f"del {', '.join(a.name for a in bsym.args)}"[:80]
    lines = bsym.python(indent=0)
    if not lines or lines[0].startswith("#"):  # unpack_trivial prints only a comment
        outs = ", ".join(p.name for p in bsym.flat_proxy_outs)
        return f"{outs} = {bsym.sym.name}"
    line = lines[0].split("  #")[0]
    return line[: line.index("(")] if "(" in line else line[:80]


def program_steps(fw_trace: TraceCtx, bw_trace: TraceCtx | None) -> tuple[Step, ...]:
    """One ``Step`` per bound symbol: the forward's, then the backward's."""
    return tuple(Step(i, phase, _label(b)) for i, (phase, b) in enumerate(_joint(fw_trace, bw_trace)))


def forward_return(fw_trace: TraceCtx) -> tuple[list[Proxy], list[Proxy]]:
    """(output and flat_output tensors, saved-for-backward tensors) of the forward's return."""
    ret = fw_trace.bound_symbols[-1]
    if ret.sym.id != PrimIDs.RETURN:
        return [], []
    match ret.args:
        case (dict(), (_, _)):  # the augmented forward of thunder/transforms/autodiff.py
            return _tensors(forward_outputs(fw_trace)), _tensors(forward_saved(fw_trace)[0])
        case _:
            return _tensors(ret.flat_proxy_args), []


def joint_graph(fw_trace: TraceCtx, bw_trace: TraceCtx | None) -> nx.DiGraph:
    """The joint program as a DAG, producer -> tensor -> consumer; step nodes by index, tensor nodes by name."""
    joint = _joint(fw_trace, bw_trace)
    bw_start = first_backward(phase for phase, _ in joint)
    # collected first and added in bulk: one add_node/add_edge call per use would dominate this function
    nodes: list[tuple[int | str, dict]] = []
    edges: list[tuple[int | str, int | str]] = []
    tensors: dict[str, dict] = {}
    region_views: list[tuple[str, str]] = []

    def add_tensor(p: Proxy, start: int) -> None:
        if p.name not in tensors:
            attrs = dict(proxy=p, nbytes=tensor_nbytes(p), start=start, held_until=start)
            tensors[p.name] = attrs
            nodes.append((p.name, attrs))

    for p in _tensors(forward_inputs(fw_trace)):
        add_tensor(p, 0)
        tensors[p.name]["held_until"] = bw_start - 1
    for i, (phase, bsym) in enumerate(joint):
        nodes.append((i, dict(index=i, phase=phase, bsym=bsym)))
        input_start = 0 if phase == "forward" else bw_start
        for p in _tensors(bsym.flat_proxy_args):
            add_tensor(p, input_start)  # an input nothing produced
            edges.append((p.name, i))
        unpack = is_unpack(bsym)
        for p in _tensors(bsym.flat_proxy_outs):
            if unpack:  # a trace input under its name: a use if known, else an input
                if p.name in tensors:
                    edges.append((p.name, i))
                else:
                    add_tensor(p, input_start)
            elif p.name not in tensors:  # a known name is passed through, not allocated
                add_tensor(p, i)
                edges.append((i, p.name))
        if bsym.sym.is_fusion and not unpack:
            aliasing = region_aliasing(bsym)
            region_views += aliasing.views_of.items()
            for outs, nbytes in aliasing.shared:
                for o in outs:
                    tensors[o]["storage_nbytes"] = nbytes
                region_views += ((outs[0], o) for o in outs[1:])

    outputs, saved = forward_return(fw_trace)
    for p in outputs:
        tensors[p.name]["held_until"] = max(tensors[p.name]["held_until"], bw_start - 1)
    for p in saved:
        tensors[p.name]["held_until"] = max(tensors[p.name]["held_until"], min(bw_start, len(joint) - 1))
    if bw_trace is not None and bw_trace.bound_symbols and bw_trace.bound_symbols[-1].sym.id == PrimIDs.RETURN:
        for p in _tensors(bw_trace.bound_symbols[-1].flat_proxy_args):
            tensors[p.name]["held_until"] = len(joint) - 1
    g = nx.DiGraph(backward_start=bw_start, region_views=region_views)
    g.add_nodes_from(nodes)
    g.add_edges_from(edges)
    return g


def uses(graph: nx.DiGraph, names: Iterable[str]) -> tuple[int, ...]:
    """Sorted steps that really use any of ``names`` (unpacks included)."""
    steps = {c for n in names for c in graph.successors(n) if not is_bookkeeping(graph.nodes[c]["bsym"])}
    return tuple(sorted(steps))


def view_graph(graph: nx.DiGraph) -> nx.DiGraph:
    """Tensor names, with an edge from each tensor to every tensor viewing its storage directly."""
    views = nx.DiGraph()
    views.add_nodes_from(n for n in graph if isinstance(n, str))
    for i in (n for n in graph if isinstance(n, int)):
        bsym = graph.nodes[i]["bsym"]
        if bsym.sym.name in VIEW_OPS and (ins := _tensors(bsym.flat_proxy_args)):
            views.add_edges_from((ins[0].name, out) for out in graph.successors(i))
        elif bsym.sym.name.startswith(PASS_THROUGH_TOKENS):  # output k is token k
            tokens = _tensors(bsym.kwargs.get("tokens", ()))
            views.add_edges_from((t.name, o.name) for t, o in zip(tokens, _tensors(bsym.flat_proxy_outs)))
    views.add_edges_from(graph.graph.get("region_views", ()))
    return views


def storage_lives(fw_trace: TraceCtx, bw_trace: TraceCtx | None, *, nbytes_of: Callable[[Proxy], int] | None = None,
                  graph: nx.DiGraph | None = None) -> dict[str, Life]:
    """One ``Life`` per storage, by name, in order of allocation; ``nbytes_of`` overrides a storage's size."""
    g = graph if graph is not None else joint_graph(fw_trace, bw_trace)
    nodes = g.nodes
    order = {n: k for k, n in enumerate(g)}  # order of first appearance
    last_use = last_uses(g)
    lives = []
    for group in nx.weakly_connected_components(view_graph(g)):  # tensor names grouped by storage
        members = sorted(group, key=lambda n: (nodes[n]["start"], order[n]))
        rep = nodes[members[0]]
        if "storage_nbytes" in rep:  # a buffer a fusion region allocates and its outputs view
            nbytes = rep["storage_nbytes"]
        else:
            nbytes = rep["nbytes"] if nbytes_of is None else int(nbytes_of(rep["proxy"]))
        lives.append(Life(members[0], tuple(members), nbytes, rep["start"], held_to(g, members, last_use)))
    lives.sort(key=lambda life: (life.start, order[life.name]))
    return {life.name: life for life in lives}


def last_uses(graph: nx.DiGraph) -> dict[str, int]:
    """The last step that really uses each tensor, for every tensor with a use."""
    nodes, last = graph.nodes, {}
    for i in graph:
        if type(i) is int and not is_bookkeeping(nodes[i]["bsym"]):
            for name in graph.pred[i]:
                if last.get(name, -1) < i:
                    last[name] = i
    return last


def held_to(graph: nx.DiGraph, names: Iterable[str], last_use: Mapping[str, int]) -> int:
    """The last step any of ``names`` is held to: its last use, or where it is held without uses."""
    return max(max(last_use.get(n, 0), graph.nodes[n]["held_until"]) for n in names)


def storage_of(lives: Mapping[str, Life]) -> dict[str, Life]:
    """Tensor name -> the life of the storage it belongs to."""
    return {m: life for life in lives.values() for m in life.members}


def span_bytes(spans: Iterable[tuple[int, int, int]], n_steps: int) -> np.ndarray:
    """Bytes live at each of ``n_steps`` steps, summed over ``(start, end, nbytes)`` spans (inclusive)."""
    arr = np.asarray(list(spans), dtype=np.int64).reshape(-1, 3)
    delta = np.zeros(n_steps + 1, dtype=np.int64)
    np.add.at(delta, arr[:, 0], arr[:, 2])
    np.add.at(delta, arr[:, 1] + 1, -arr[:, 2])
    return np.cumsum(delta[:-1])


def life_spans(lives: Iterable[Life]) -> Iterable[tuple[int, int, int]]:
    return ((life.start, life.end, life.nbytes) for life in lives)


def first_backward(phases: Iterable[str]) -> int:
    """Index of the first ``"backward"`` phase, or their number: the one rule for the backward's start."""
    phases = list(phases)
    return phases.index("backward") if "backward" in phases else len(phases)


def backward_start(steps: Sequence[Step]) -> int:
    """Index of the first backward step of ``steps`` (``len(steps)`` when there is none)."""
    return first_backward(s.phase for s in steps)


def timeline(lives: Mapping[str, Life], steps: tuple[Step, ...]) -> Timeline:
    """Bytes live at each step, summed over the lives (each live on [start, end], inclusive)."""
    live = span_bytes(life_spans(lives.values()), len(steps)).tolist()
    return Timeline(tuple(steps), tuple(live), backward_start(steps))


def with_sharding(lives: Mapping[str, Life], steps: tuple[Step, ...], groups: Iterable[ShardedStorages]
                  ) -> dict[str, Life]:
    """The lives after sharding: each group's storages end at ``shard_at``, then its shard, gathered buffer and scratch
    live as the group says. Raises ``ValueError`` for an order the pass cannot produce."""
    out = dict(lives)
    for s in groups:
        members = [lives[n] for n in s.lives]
        in_fw, in_bw = steps[s.shard_at].phase == "forward", steps[s.gather_at].phase == "backward"
        until = s.first_use if s.shard_until is None else s.shard_until
        ok = in_fw and in_bw and s.shard_at < s.gather_at <= s.first_use <= until
        if not (ok and members and all(m.start <= s.shard_at and s.first_use <= m.end for m in members)):
            spans = ", ".join(f"{m.name} [{m.start}, {m.end}]" for m in members)
            raise ValueError(f"cannot shard {spans} as {s}")
        for m in members:
            out[m.name] = replace(m, end=s.shard_at)
        out[f"{s.name}.shard"] = Life(f"{s.name}.shard", (), s.shard_nbytes, s.shard_at, until)
        everyone = tuple(n for m in members for n in m.members)
        out[f"{s.name}.gathered"] = Life(f"{s.name}.gathered", everyone, s.gathered_nbytes, s.gather_at,
                                         max(m.end for m in members))
        if s.scratch_nbytes:
            out[f"{s.name}.scratch"] = Life(f"{s.name}.scratch", (), s.scratch_nbytes, s.gather_at, s.first_use)
    return out


@dataclass(frozen=True)
class CompactedStorage:
    """Compacting one storage: it ends at ``compact_at``; view ``members[k]`` becomes a copy of ``nbytes[k]`` bytes
    until ``ends[k]``."""

    life: str
    members: tuple[str, ...]
    nbytes: tuple[int, ...]
    compact_at: int
    ends: tuple[int, ...]


def with_compaction(lives: Mapping[str, Life], compactions: Iterable[CompactedStorage]) -> dict[str, Life]:
    """The lives after compaction; ``"<life>.compact<k>"`` is the copy of its ``k``-th saved view."""
    out = dict(lives)
    for c in compactions:
        life = lives[c.life]
        if not life.start <= c.compact_at < min(c.ends) or max(c.ends) > life.end:
            raise ValueError(f"cannot compact {life.name} [{life.start}, {life.end}] as {c}")
        out[c.life] = replace(life, end=c.compact_at)
        for k, (m, nbytes, end) in enumerate(zip(c.members, c.nbytes, c.ends)):
            out[f"{c.life}.compact{k}"] = Life(f"{c.life}.compact{k}", (m,), nbytes, c.compact_at, end)
    return out

