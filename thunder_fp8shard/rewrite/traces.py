"""The mechanical rewrite: the forward saves one 1/k shard per shard op and compact copies of compacted
views, the backward all-gathers each bucket back, each operator where the plan says. :func:`requests` anchors the
plan's steps on the traces' bound symbols; :func:`rewrite_forward` and :func:`rewrite_backward` return new traces
(the inputs are not modified).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from thunder.core.prims import PrimIDs
from thunder.core.proxies import AnyProxy, TensorProxy, variableify
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace, tracectx
from thunder.core.transforms import (
    _update_backward_with_new_saved_for_backward,
    _update_forward_with_new_saved_for_backward,
)
from thunder.executors.passes import del_last_used
from thunder.executors.pythonex import clear_mutable_collection

from thunder_fp8shard.memory.model import MemoryModel
from thunder_fp8shard.planning.grouping import prefetched_by
from thunder_fp8shard.runtime.audit import SavedStorage
from thunder_fp8shard.runtime import ops
from thunder_fp8shard.plan import ShardPlan
from thunder_fp8shard.analysis.program import ProgramFacts
from thunder_fp8shard.analysis.saved import backward_saved, body_without_dels


@dataclass(frozen=True)
class BucketRequest:
    """Saved tensors all-gathered together: where this rank's shard lies in its shard op's output, and the
    bound symbols the backward waits before and starts the all-gather before (None: at the top)."""

    members: tuple[TensorProxy, ...]
    shard_offset: int
    shard_nbytes: int
    wait_before: BoundSymbol
    start_before: BoundSymbol | None
    sources: tuple[TensorProxy, ...] = ()  # Bucket.sources: no shard op


@dataclass(frozen=True)
class ShardOpRequest:
    """One forward shard op, right after ``after``: the buckets whose shards it keeps in one tensor, and the
    saved views it replaces by compact copies."""

    buckets: tuple[BucketRequest, ...]
    shard_nbytes: int
    after: BoundSymbol
    compact: tuple[TensorProxy, ...] = ()


@dataclass(frozen=True)
class CompactionRequest:
    """Saved views replaced by compact copies of themselves, made right after ``after``."""

    members: tuple[TensorProxy, ...]
    after: BoundSymbol


def requests(plan: ShardPlan, facts: ProgramFacts) -> tuple[list[ShardOpRequest], list[CompactionRequest]]:
    """The plan's shard ops and compactions as requests anchored on the bound symbols of the program the
    plan was made on."""
    fw, bw, n_fw = facts.forward, facts.backward, facts.backward_start
    proxy_of = {p.name: p for p in facts.saved}
    input_of = {p.name: p for p in facts.inputs} if any(b.sources for b in plan.buckets) else {}
    ops_of: dict[int, list[BucketRequest]] = {}
    after: dict[int, BoundSymbol] = {}
    for j, b in enumerate(plan.buckets):
        start = None if prefetched_by(j, plan.prefetch) is None else bw.bound_symbols[b.gather_at - n_fw]
        ops_of.setdefault(b.shard_op, []).append(BucketRequest(
            tuple(proxy_of[n] for n in b.members), b.shard_offset, b.shard_nbytes, bw.bound_symbols[b.first_use - n_fw],
            start, tuple(input_of[n] for n in b.sources)))
        after[b.shard_op] = fw.bound_symbols[b.shard_at]
    by_op: dict[int, list[TensorProxy]] = {}
    by_step: dict[int, list[TensorProxy]] = {}  # one fp8shard_compact call a step
    for c in plan.compacted:
        into = by_op.setdefault(c.shard_op, []) if c.shard_op is not None else by_step.setdefault(c.compact_at, [])
        into.extend(proxy_of[m] for m in c.members)
    nbytes = plan.shard_op_nbytes
    shard_ops = [ShardOpRequest(tuple(rs), nbytes[op], after[op], tuple(by_op.get(op, ()))) for op, rs in ops_of.items()]
    compactions = [CompactionRequest(tuple(ms), fw.bound_symbols[step]) for step, ms in by_step.items()]
    return shard_ops, compactions


@dataclass(frozen=True)
class ShardedBucket:
    """What the forward hands to the backward for one bucket."""

    originals: tuple[TensorProxy, ...]  # the wait re-creates them
    shard: TensorProxy | tuple  # the op's flat uint8 shard, or the bucket's sources
    shard_offset: int | tuple  # for sources, each member's offset in the gathered buffer
    shard_nbytes: int  # for sources, the gathered buffer's
    restorer: AnyProxy
    request: BucketRequest


@dataclass(frozen=True)
class ForwardRewrite:
    trace: TraceCtx
    sharded: tuple[ShardedBucket, ...]
    shards: tuple[TensorProxy, ...]  # saved instead of the sharded tensors
    saved: tuple  # the new saved-for-backward list (tensors then others)
    k: int
    compacted: tuple[tuple[TensorProxy, TensorProxy], ...]  # (view, its compact copy)


def rewrite_forward(
    facts: ProgramFacts, shard_ops: list[ShardOpRequest], *, group, k: int, method: str, verify: bool,
    provenance: str, compactions: list[CompactionRequest] = (),
) -> ForwardRewrite:
    """Inserts each ``fp8shard_shard`` and ``fp8shard_compact`` after its bound symbol and saves their shards,
    restorers and compact copies instead of what they replace. A bucket whose shard is a forward input saves the input
    and its restorer is a backward constant (:class:`~thunder_fp8shard.runtime.ops.SourceRestorer`)."""
    fw = facts.forward
    body = body_without_dels(fw)
    position = {id(b): i for i, b in enumerate(body)}
    new = from_trace(fw)
    inserted_after: dict[int, list[BoundSymbol]] = {}
    sharded: list[ShardedBucket] = []
    shards = []
    compacted: dict[str, tuple[TensorProxy, TensorProxy]] = {}
    for c in compactions:
        copies, scope = _recorded(new, lambda: ops.compact(c.members, ops.CompactCopies()))
        inserted_after.setdefault(position[id(c.after)], []).extend(scope)
        compacted.update((m.name, (m, copy)) for m, copy in zip(c.members, copies))
    for op in shard_ops:
        if op.buckets[0].sources:  # nothing to insert
            (r,) = op.buckets
            restorer = ops.SourceRestorer.of(r.members, k)
            sharded.append(ShardedBucket(r.members, r.sources, restorer.offsets, restorer.nbytes, restorer, r))
            shards.extend(r.sources)
            continue
        members = tuple(r.members for r in op.buckets)
        names = tuple(tuple(p.name for p in m) for m in members)
        spec = ops.ShardSpec(group, k, tuple(r.shard_nbytes for r in op.buckets), method, verify, names)
        if spec.shard_nbytes != op.shard_nbytes:
            raise ValueError(f"a shard op of {op.shard_nbytes:,} B a rank whose buckets' shards add up to "
                             f"{spec.shard_nbytes:,} B")
        views = (op.compact,) if op.compact else ()
        (shard, *outputs), scope = _recorded(new, lambda: ops.shard(members, spec, *views))
        restorers, copies = outputs[: len(op.buckets)], outputs[len(op.buckets) :]
        compacted.update((m.name, (m, copy)) for m, copy in zip(op.compact, copies))
        inserted_after.setdefault(position[id(op.after)], []).extend(scope)
        shards.append(shard)
        sharded += [ShardedBucket(r.members, shard, r.shard_offset, r.shard_nbytes, restorer, r)
                    for r, restorer in zip(op.buckets, restorers)]
    new.bound_symbols = [b for i, b in enumerate(body) for b in (b, *inserted_after.get(i, ()))]

    gone = {p.name for s in sharded for p in s.originals}
    saved = (
        *(compacted[p.name][1] if p.name in compacted else p for p in facts.saved if p.name not in gone),
        *shards,
        *facts.saved_other,
        *(s.restorer for s in sharded if isinstance(s.restorer, AnyProxy)),
    )
    _update_forward_with_new_saved_for_backward(new, saved)
    out = del_last_used(new)
    out.set_provenance(TraceProvenance(provenance))
    return ForwardRewrite(out, tuple(sharded), tuple(shards), saved, k, tuple(compacted.values()))


def rewrite_backward(bw: TraceCtx, handoff: ForwardRewrite, *, group, provenance: str) -> tuple[TraceCtx, list[int]]:
    """Restores each bucket before its first consumer (``fp8shard_gather_wait``) after starting its all-gather
    where its request says; a wait and a start at one place are one ``fp8shard_gather_next``. Compacted views are
    read from their copies. Returns the new trace and the indices of the bound symbols that issue the gathers.
    """
    saved_tensors, _ = backward_saved(bw)
    if len(saved_tensors) != sum(1 for x in handoff.saved if isinstance(x, TensorProxy)) - len(handoff.shards) + sum(
        len(s.originals) for s in handoff.sharded
    ):
        raise RuntimeError("ShardIntermediates: the backward trace does not match the forward it was handed")
    # what Thunder regenerates below (unpacks of the saved list, dels and clears) is dropped
    body = [b for b in bw.bound_symbols if b.sym is not clear_mutable_collection and b.sym.id not in (
        PrimIDs.DEL, PrimIDs.UNPACK_SEQUENCE, PrimIDs.UNPACK_TRIVIAL, PrimIDs.UNPACK_EMPTY_DICT, PrimIDs.UNPACK_KEY)]
    position = {id(b): i for i, b in enumerate(body)}
    if handoff.compacted:
        swap = {variableify(view): copy for view, copy in handoff.compacted}
        body = [b.from_bsym_swap_proxies(swap) for b in body]
    new = from_trace(bw)
    before: dict[int, list[BoundSymbol]] = {}
    with tracectx(new):
        for s in handoff.sharded:
            r = s.request
            handle, scope = _recorded(
                new, lambda: ops.gather_start(s.shard, s.shard_offset, s.shard_nbytes, handoff.k, group))
            before.setdefault(0 if r.start_before is None else position[id(r.start_before)], []).extend(scope)
            wait = ops.gather_wait.bind(handle, s.restorer, output=tuple(s.originals))
            before.setdefault(position[id(r.wait_before)], []).append(wait)
    new.bound_symbols = [b for i, b in enumerate(body) for b in (*_fused(before.get(i, ())), b)]
    _update_backward_with_new_saved_for_backward(new, handoff.saved)
    out = del_last_used(new, clear_mutable_collections=True)
    out.set_provenance(TraceProvenance(provenance))
    gathers = [i for i, b in enumerate(out.bound_symbols) if b.sym in (ops.gather_start, ops.gather_next)]
    return out, gathers


def expected_storages(model: MemoryModel, plan: ShardPlan, rewrite: ForwardRewrite) -> list[SavedStorage]:
    """The model's storages of the rewritten forward's saved tensors, each with the steps it is held: an
    unchanged tensor's storage life, a compact copy's own, a shard op's from the op to its last bucket's wait."""
    life_of = model.life_of
    copy_of = {view.name: copy for view, copy in rewrite.compacted}
    copies = {copy_of[m].name: (c, j) for c in plan.compacted for j, m in enumerate(c.members)}
    made = [s for s in rewrite.sharded if not s.request.sources]  # sources live as the inputs
    shard_ops = {s.shard.name: [] for s in made}
    for s in made:
        shard_ops[s.shard.name].append(s)
    buckets = {b.members: b for b in plan.buckets}
    found: dict[str, SavedStorage] = {}
    tensors = [p for p in rewrite.saved if isinstance(p, TensorProxy)]
    for k, p in enumerate(tensors):
        if p.name in copies:
            c, j = copies[p.name]
            e = SavedStorage(f"{c.storage}.compact{j}", (), c.member_nbytes[j], c.compact_at, c.ends[j])
        elif p.name in shard_ops:
            mine = [buckets[tuple(m.name for m in s.originals)] for s in shard_ops[p.name]]
            e = SavedStorage(f"shard op {mine[0].shard_op}", (), sum(b.shard_nbytes for b in mine),
                             max(b.shard_at for b in mine), max(b.shard_until or b.first_use for b in mine))
        else:
            life = life_of[p.name]
            e = SavedStorage(life.name, (), life.nbytes, life.start, life.end)
        prior = found.get(e.name, e)
        found[e.name] = SavedStorage(e.name, (*prior.members, k), e.nbytes, e.start, e.end)
    return list(found.values())


def with_run_checks(handoff: ForwardRewrite, bw: TraceCtx, audit, calibration) -> tuple[TraceCtx, TraceCtx]:
    """The rewritten forward and the backward with their run-time checks before their returns
    (:mod:`thunder_fp8shard.runtime.audit`)."""
    out = []
    for trace, insert in ((handoff.trace, lambda: ops.audit(tuple(p for p in handoff.saved if isinstance(
            p, TensorProxy)), audit)), (bw, lambda: ops.calibrate(calibration))):
        new = from_trace(trace)
        _, scope = _recorded(new, insert)
        body = list(trace.bound_symbols)
        at = max(i for i, b in enumerate(body) if b.sym.id == PrimIDs.RETURN)
        new.bound_symbols = [*body[:at], *scope, *body[at:]]
        new.set_provenance(trace.get_provenance())
        out.append(new)
    return out[0], out[1]


def _recorded(trace: TraceCtx, call: Callable[[], object]) -> tuple[object, list[BoundSymbol]]:
    """What ``call()`` returns, and the bound symbols it records in ``trace`` (kept out of its body)."""
    scope: list[BoundSymbol] = []
    with tracectx(trace):
        trace.push_scope(scope)
        out = call()
        trace.pop_scope()
    return out, scope


def _fused(inserted: list[BoundSymbol]) -> list[BoundSymbol]:
    """The operators inserted at one place, each wait followed by a start fused into one
    ``fp8shard_gather_next`` (they touch different buckets)."""
    out: list[BoundSymbol] = []
    for b in inserted:
        if b.sym is ops.gather_start and out and out[-1].sym is ops.gather_wait:
            wait = out.pop()
            out.append(ops.gather_next.bind(*wait.args, *b.args, output=(*wait.output, b.output)))
        else:
            out.append(b)
    return out


def operator_calls(fw: TraceCtx, bw: TraceCtx) -> dict[str, int]:
    """How many times a step the rewritten traces call each of the pass's run-time operators."""
    mine = (ops.shard, ops.gather_start, ops.gather_next, ops.gather_wait, ops.compact, ops.audit, ops.calibrate)
    return {sym.name: sum(b.sym is sym for t in (fw, bw) for b in t.bound_symbols) for sym in mine}
