"""``fp8_forward_gather``: all-gather TE linear weights in FP8 in the forward (``docs/fp8_forward_gather.md``).

Under Thunder FSDP each rank all-gathers bf16 weights and TE casts every full weight to FP8. Where the gathered
weight's only use is one TE linear, each rank instead casts its own rows and all-gathers the FP8 bytes
(:mod:`thunder_fp8shard.runtime.fp8_gather_ops`), bitwise exact under the conditions :func:`find_sites` checks; a
weight failing one keeps its bf16 gather and the plan says why. Casting early is exact because the weight's scale
changes only in its state's scale update, which eligibility requires after the linear and not before it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from thunder.core import dtypes
from thunder.core.prims import PrimIDs
from thunder.core.proxies import Proxy, TensorProxy
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace, tracectx

from thunder_fp8shard.analysis.fsdp_gathers import Gather
from thunder_fp8shard.analysis.liveness import readers
from thunder_fp8shard.analysis.names import (
    ALL_GATHER, TE_LINEAR_FWD, TE_QUANTIZERS, TE_RECIPE, TE_SCALE_UPDATE, TE_STATE,
)
from thunder_fp8shard.analysis.program import ProgramFacts
from thunder_fp8shard.analysis.saved import body_without_dels, forward_inputs
from thunder_fp8shard.runtime import fp8_gather_ops as gops
from thunder_fp8shard.plan import ForwardGather, ShardPlan
from thunder_fp8shard.rewrite.shape import Effect, Program, Rewrite, Rewritten



@dataclass(frozen=True)
class Site:
    """One TE linear forward whose weight comes from a forward all-gather; ``why``: None where eligible, else
    the first reason it is not."""

    linear: BoundSymbol
    gather: BoundSymbol | None
    wait: BoundSymbol | None
    slice: BoundSymbol | None
    quantizers: BoundSymbol | None
    shard: TensorProxy | None  # the trace input all-gathered
    weight: TensorProxy  # the unpadded gathered weight
    why: str | None


@dataclass(frozen=True)
class _Forward:
    """A forward trace read once: its bound symbols without dels, their positions, each proxy's producer,
    and the trace's input names."""

    body: list[BoundSymbol]
    index: dict[int, int]  # id(bound symbol) -> position in ``body``
    producer: dict[str, BoundSymbol]
    inputs: frozenset[str]


def _forward(body: Sequence[BoundSymbol], inputs: Sequence[Proxy]) -> _Forward:
    return _Forward(list(body), {id(b): i for i, b in enumerate(body)},
                    {o.name: b for b in body for o in b.flat_proxy_outs}, frozenset(p.name for p in inputs))


def _is_row_slice(b: BoundSymbol, src: TensorProxy, dst: TensorProxy) -> bool:
    """``dst = src[:rows]`` along dim 0, every other dim whole, stride 1."""
    args = b.args
    if len(args) < 3 or args[0] is not src:
        return False
    start, end = list(args[1]), list(args[2])
    strides = list(args[3]) if len(args) > 3 and args[3] is not None else [1] * len(start)
    shape = list(src.shape)
    return (all(s == 0 for s in start) and all(s == 1 for s in strides) and end[1:] == shape[1:]
            and 0 < end[0] <= shape[0] and list(dst.shape) == [end[0], *shape[1:]])


def find_sites(facts: ProgramFacts, *, group, world_size: int, default_world_size: int,
               recipe_problem: str | None) -> list[Site]:
    """Every TE linear forward of the program's forward whose weight is a forward all-gather's, with the first reason
    it cannot be gathered in FP8 (None: it can)."""
    f = _forward(facts.body, facts.args)
    body, producer, inputs, position = f.body, f.producer, f.inputs, f.index
    uses = {name: [body[i] for i in at] for name, at in readers(body).items()}
    returned = {p.name for b in facts.forward.bound_symbols if b.sym.id == PrimIDs.RETURN for p in b.flat_proxy_args}
    recomputed = any(b.sym.name.startswith(TE_LINEAR_FWD) for b in facts.backward.bound_symbols)
    first_update, last_update = {}, {}  # proxy -> its first and last scale update
    for i, b in enumerate(body):
        if b.sym.name.startswith(TE_SCALE_UPDATE):
            for p in b.flat_proxy_args:
                first_update.setdefault(p.name, i)
                last_update[p.name] = i
    chains: dict[str, tuple[Gather, BoundSymbol | None]] = {}  # weight -> its gather and the slice making it
    for g in facts.gathers:
        chains.setdefault(g.gathered.name, (g, None))
        for sl in g.slices:
            chains.setdefault(sl.output.name, (g, sl))
    sites = []
    for lin in body:
        if not lin.sym.name.startswith(TE_LINEAR_FWD):
            continue
        w = lin.args[1]
        if getattr(w, "name", None) not in chains:
            continue  # not a forward-gathered weight: nothing to say
        g, sl = chains[w.name]
        gathered = sl.args[0] if sl is not None else w
        why = None
        if sl is not None and not _is_row_slice(sl, sl.args[0], w):
            why = "the weight is a slice of the gathered weight other than dropping its padding rows"
        q_w = lin.args[4] if len(lin.args) > 4 else None
        qb = producer.get(getattr(q_w, "name", None))
        if why is None:
            state = getattr(qb.args[0], "name", None) if qb is not None and qb.args else None
            at = position[id(lin)]
            why = _first_problem(
                gather=g.gather, shard=g.shard, wait=g.wait, slice_=sl, linear=lin, gathered=gathered, weight=w,
                quantizers=qb, q_w=q_w, producer=producer, uses=uses, returned=returned, inputs=inputs,
                group=group, world_size=world_size, default_world_size=default_world_size,
                recipe_problem=recipe_problem, recomputed=recomputed,
                updated_after=state is not None and last_update.get(state, -1) > at,
                updated_before=state is not None and first_update.get(state, len(body)) < at)
        sites.append(Site(lin, g.gather, g.wait, sl, qb, g.shard if isinstance(g.shard, TensorProxy) else None, w, why))
    return sites


def _first_problem(*, gather, shard, wait, slice_, linear, gathered, weight, quantizers, q_w, producer, uses,
                   returned, inputs, group, world_size, default_world_size, recipe_problem, recomputed, updated_after,
                   updated_before):
    if world_size < 2:
        return "one rank: nothing is gathered"
    if recipe_problem is not None:
        return recipe_problem
    if default_world_size != world_size:
        return (f"FSDP's group has {world_size} ranks but TE all-reduces the amax over the default group's "
                f"{default_world_size}")
    if recomputed:
        return "a TE linear forward is recomputed in the backward (activation checkpointing)"
    if not isinstance(shard, TensorProxy) or shard.name not in inputs:
        return "the all-gathered tensor is not a trace input (a parameter shard)"
    if gather.args[1] is not group:
        return "all-gathered over a process group other than FSDP's"
    if len(gather.args) > 3 and gather.args[3] not in (None, 0):
        return "all-gathered along a dim other than 0"
    if len(shard.shape) != 2 or len(weight.shape) != 2:
        return "not a 2-D weight"
    for p, what in ((gathered, "gathered weight"), (weight, "unpadded weight")):
        if p.name in returned:
            return f"the {what} is returned or saved for backward"
    if [b for b in uses.get(wait.args[0].name, []) if b is not wait]:
        return "the all-gather's handle has another use"
    others = [b for b in uses.get(gathered.name, []) if b is not (slice_ or linear)]
    if slice_ is not None:
        others += [b for b in uses.get(weight.name, []) if b is not linear]
    if others:
        return f"the gathered weight has another use ({others[0].sym.name}): a tied or non-TE consumer"
    if sum(1 for a in linear.args[:4] if getattr(a, "name", None) == weight.name) != 1:
        return "the weight is also another argument of the linear"
    if quantizers is None or not quantizers.sym.name.startswith(TE_QUANTIZERS):
        return "the weight quantizer is not a get_te_fp8_quantizers output"
    outs = list(quantizers.flat_proxy_outs)
    if len(outs) != 2 or outs[1].name != q_w.name:
        return "the weight quantizer is not output 1 of its forward state's two quantizers"
    state = quantizers.args[0]
    sb = producer.get(getattr(state, "name", None))
    if sb is None or not sb.sym.name.startswith(TE_STATE) or tuple(sb.args[1:3]) != ("forward", 2):
        return "the weight quantizer does not come from a forward TE state"
    if updated_before:
        return ("a te_fp8_amax_and_scale_update of the linear's state precedes it in the forward: casting the weight "
                "where its all-gather starts could use another scale than the linear would")
    if len(linear.args) != 5 or linear.kwargs:
        return "the TE linear forward's arguments are not (input, weight, bias, input quantizer, weight quantizer)"
    ctx = getattr(linear, "_call_ctx", None) or {}
    if not (ctx.get(linear.sym.name) or len(ctx) == 1):
        return "the TE linear forward has no Python implementation for the fused operator to call"
    if not updated_after:
        return ("no te_fp8_amax_and_scale_update of the linear's state follows it in the forward: the shards' amaxes "
                "would not be all-reduced before a scale update")
    rows, out = shard.shape[0], weight.shape[0]
    if gathered.shape[0] != rows * world_size or out > rows * world_size:
        return "the gathered shape is not the shards' concatenation"
    if rows != -(-out // world_size):
        return (f"the weight keeps {out} of the {rows * world_size} gathered rows: a slice other than dropping its "
                f"padding rows (FSDP's shards of a {out}-row weight have {-(-out // world_size)} rows)")
    if out <= (world_size - 1) * rows:
        return "a rank would hold no valid row of the weight"
    return None


def decisions(sites: Sequence[Site], world_size: int) -> list[ForwardGather]:
    """The plan's rows: per site, bytes received and elements cast per rank, without and with."""
    out = []
    for s in sites:
        shape = tuple(int(d) for d in s.weight.shape)
        numel = math.prod(shape)
        rows = int(s.shard.shape[0]) if s.shard is not None else shape[0]
        gathered = rows * world_size * math.prod(shape[1:])  # padding included
        before = gathered * s.weight.dtype.bytes * (world_size - 1) // world_size
        fp8 = s.why is None
        after = gathered * (world_size - 1) // world_size if fp8 else before
        cast_after = numel if not fp8 else _valid_rows(shape[0], rows, 0) * shape[1]  # rank 0 holds the most rows
        out.append(ForwardGather(s.shard.name if s.shard is not None else s.weight.name, shape, fp8,
                                 "FP8: this rank's rows cast, the uint8 bytes gathered" if fp8 else s.why,
                                 before, after, numel, cast_after))
    return out


def _valid_rows(out: int, rows: int, rank: int) -> int:
    return max(0, min(rows, out - rank * rows))


HOISTABLE = (TE_RECIPE, TE_STATE, TE_QUANTIZERS)  # TE's getters: no tensor input, order-independent


def _getters(site: Site, producer: dict[str, BoundSymbol], inputs: set[str]) -> list[BoundSymbol] | None:
    """The TE getters the weight quantizer comes from, or None where one is not a TE getter (then they
    cannot be moved up)."""
    out, todo, seen = [], [site.quantizers], set()
    while todo:
        b = todo.pop()
        if id(b) in seen:
            continue
        seen.add(id(b))
        if not b.sym.name.startswith(HOISTABLE):
            return None
        out.append(b)
        for p in b.flat_proxy_args:
            if p.name in inputs:
                continue
            if p.name not in producer:
                return None
            todo.append(producer[p.name])
    return out


def batches(f: _Forward, sites: Sequence[Site]) -> list[tuple[int, list[Site], list[BoundSymbol]]]:
    """Where the eligible sites' starts go, as ``(index, sites, getters)``: one call per run of adjacent
    forward all-gathers, after its last one, preceded by the quantizer getters it needs, moved up (TE's getters take
    no tensor, and creating a state does not depend on when). Other sites start alone."""
    body, index, producer, inputs = f.body, f.index, f.producer, f.inputs
    chosen = sorted((s for s in sites if s.why is None), key=lambda s: index[id(s.gather)])
    runs: list[list[Site]] = []
    alone: list[Site] = []
    last = None
    getters_of = {id(s): _getters(s, producer, inputs) for s in chosen}
    for s in chosen:
        if getters_of[id(s)] is None:
            alone.append(s)
            continue
        i = index[id(s.gather)]
        if last is not None and all(b.sym.name == ALL_GATHER or b.sym.id in (PrimIDs.UNPACK_TRIVIAL, PrimIDs.COMMENT)
                                    for b in body[last + 1:i]):
            runs[-1].append(s)
        else:
            runs.append([s])
        last = i
    out = []
    moved: set[int] = set()
    for run in runs:
        at = max(index[id(s.gather)] for s in run)
        getters = []
        for s in run:
            for g in getters_of[id(s)]:
                if index[id(g)] > at and id(g) not in moved:
                    moved.add(id(g))
                    getters.append(g)
        out.append((at, run, sorted(getters, key=lambda g: index[id(g)])))
    out += [(max(index[id(s.gather)], index[id(s.quantizers)]), [s], []) for s in alone]
    return sorted(out, key=lambda x: x[0])


def rewrite(fw: TraceCtx, sites: Sequence[Site], *, group, world_size: int, rank: int, provenance: str) -> TraceCtx:
    """``fw`` with each eligible site's all-gather, wait, slice and TE linear replaced by a batched
    ``fp8shard_weight_gather_starts`` (:func:`batches`) and an ``fp8shard_te_linear_fwd`` where the linear was.
    ``fw`` is not modified."""
    from thunder.executors.passes import del_last_used

    f = _forward(body_without_dels(fw), forward_inputs(fw))  # the forward as rewritten so far
    plan = batches(f, sites)
    if not plan:
        return fw
    body, index = f.body, f.index
    gone = {id(b) for _, run, getters in plan for s in run for b in (s.gather, s.wait, s.slice, *getters)
            if b is not None}
    after: dict[int, list[BoundSymbol]] = {}
    replace: dict[int, BoundSymbol] = {}
    new = from_trace(fw)
    with tracectx(new):
        for at, run, getters in plan:
            specs = []
            for s in run:
                shard, w = s.shard, s.weight
                rows, out = int(shard.shape[0]), int(w.shape[0])
                specs.append(gops.WeightGatherSpec(group, world_size, rank, rows, _valid_rows(out, rows, rank), out,
                                                   int(w.shape[1]), dtypes.to_torch_dtype(w.dtype), shard.name,
                                                   _implementation(s.linear)))
            batch = gops.GatherBatch(specs)
            scope: list[BoundSymbol] = []
            new.push_scope(scope)
            handles = gops.weight_gather_starts(
                tuple(s.shard for s in run), tuple(s.linear.args[4] for s in run),
                tuple(f.producer[s.quantizers.args[0].name].args[0] for s in run), batch)  # the states' recipes
            new.pop_scope()
            after.setdefault(at, []).extend([*getters, *scope])
            for s, h, spec in zip(run, handles, specs):
                x, _, bias, q_in, q_w = s.linear.args[:5]
                replace[index[id(s.linear)]] = gops.te_linear_fwd.bind(x, h, bias, q_in, q_w, spec,
                                                                       output=s.linear.output)
    new.bound_symbols = [x for i, b in enumerate(body)
                         for x in ((replace[i],) if i in replace else () if id(b) in gone else (b,))
                         + tuple(after.get(i, ()))]
    out = del_last_used(new)
    out.set_provenance(TraceProvenance(provenance))
    return out


def _implementation(linear: BoundSymbol):
    """The Python function a TE linear forward bound symbol runs."""
    ctx = getattr(linear, "_call_ctx", None) or {}
    fn = ctx.get(linear.sym.name) or (next(iter(ctx.values())) if len(ctx) == 1 else None)
    if fn is None:
        raise ValueError(f"{linear.sym.name} has no Python implementation to call")
    return fn


def operator_calls(fw: TraceCtx) -> dict[str, int]:
    """How many times a forward calls each of this feature's run-time operators."""
    return {sym.name: sum(b.sym is sym for b in fw.bound_symbols) for sym in gops.OPERATORS}


def compile_time_recipe():
    """The FP8 recipe TE's executor will use, or None without TransformerEngine."""
    try:
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    except Exception:  # no TE: no TE linear in the trace either
        return None
    return FP8GlobalStateManager.get_fp8_recipe()


@dataclass(frozen=True)
class ForwardGatherPlan:
    """What :func:`plan` decided for one compilation."""

    sites: tuple[Site, ...]
    rows: tuple[ForwardGather, ...]
    group: object = None
    world_size: int = 1
    rank: int = 0

    def chosen(self, weights: Collection[str]) -> ForwardGatherPlan:
        """The plan with only the eligible sites of ``weights`` (the planner's choice) gathered in FP8."""
        sites = tuple(s if s.why is None and s.shard.name in weights else
                      dataclasses.replace(s, why=s.why or NOT_CHOSEN) for s in self.sites)
        return dataclasses.replace(self, sites=sites, rows=tuple(decisions(sites, self.world_size)))

    @property
    def calls_replaced(self) -> int:
        """Thunder's run-time calls the rewrite removes from a forward: the all-gather, its wait, the linear and a
        slice where there is one, for each eligible weight."""
        return sum(3 + (s.slice is not None) for s in self.sites if s.why is None)

    def resized(self) -> dict[str, tuple[int, dict[str, int]]]:
        """The resize items it offers, by weight: what each changes in the bytes this rank receives, and the bytes its
        buffer holds from its all-gather to its linear (gathered uint8 rows plus this rank's cast rows) by its
        proxies' names, where the trace prints a bf16 buffer."""
        moved = {r.weight: r.received_bytes_after - r.received_bytes_before for r in self.rows}
        return {s.shard.name: (moved[s.shard.name], dict.fromkeys(
            [p.name for p in (*s.gather.flat_proxy_outs, *s.wait.flat_proxy_outs)],
            int(s.shard.shape[0]) * (self.world_size + 1) * int(s.shard.shape[1])))
            for s in self.sites if s.why is None}

    def apply(self, fw: TraceCtx, provenance: str = "ShardIntermediates: fp8_forward_gather") -> TraceCtx:
        n = sum(s.why is None for s in self.sites)
        return rewrite(fw, self.sites, group=self.group, world_size=self.world_size, rank=self.rank,
                       provenance=f"{provenance}: {n} TE linear weight(s) all-gathered in FP8")


NOT_CHOSEN = "eligible, not chosen by the planner"


def plan(facts: ProgramFacts, *, enabled: bool, setup_name: str | None, group, world_size: int,
         recipe=None, default_world_size: int | None = None, rank: int | None = None) -> ForwardGatherPlan:
    """The forward-gather decisions of one compilation (none where ``enabled`` is False). Arguments left
    None are taken from TE and ``torch.distributed``."""
    if not enabled or not (setup_name or "").startswith("Thunder FSDP"):
        return ForwardGatherPlan((), ())  # only Thunder FSDP all-gathers weights in the forward
    if default_world_size is None or rank is None:
        import torch.distributed as dist

        default_world_size = dist.get_world_size() if default_world_size is None else default_world_size
        rank = dist.get_rank(group) if rank is None else rank
    recipe = compile_time_recipe() if recipe is None else recipe
    sites = tuple(find_sites(facts, group=group, world_size=world_size, default_world_size=default_world_size,
                             recipe_problem=gops.exact_recipe(recipe)))
    rows = tuple(decisions(sites, world_size))
    return ForwardGatherPlan(sites, rows, group, world_size, rank)


def sites(program: Program) -> ForwardGatherPlan:
    setup = program.setup
    return plan(program.facts, enabled=program.options.fp8_forward_gather and program.together,
                setup_name=setup and setup.name, group=setup and setup.group,
                world_size=setup.world_size if setup else 1)


def effect(program: Program, effect: Effect) -> Effect:
    return dataclasses.replace(effect, resized=program.sites["forward_gather"].resized())


def _chosen(program: Program) -> ForwardGatherPlan:
    """The sites as the planner chose among their resize items."""
    return program.sites["forward_gather"].chosen(program.choice.resized)


def decide(program: Program) -> tuple[dict, tuple[str, ...]]:
    return {"forward_gather": _chosen(program).rows}, ()


def apply(program: Program, shard_plan: ShardPlan, rewritten: Rewritten) -> Rewritten:
    forward = rewritten.forward  # the saved list is unchanged
    return Rewritten(dataclasses.replace(forward, trace=_chosen(program).apply(forward.trace)), rewritten.backward)


def count(program: Program, fw: TraceCtx) -> tuple[dict[str, int], dict]:
    """The rewritten forward's calls of this feature's operators, and the plan's (Thunder's calls they replace,
    theirs)."""
    gathers = _chosen(program)
    if not gathers.sites:
        return {}, {"forward_gather_calls": (0, 0)}
    calls = operator_calls(fw)
    return calls, {"forward_gather_calls": (gathers.calls_replaced, sum(calls.values()))}


FORWARD_GATHER = Rewrite("forward_gather", sites, effect, decide, apply, count=count)
