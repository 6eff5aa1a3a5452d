"""``reschedule``: Thunder FSDP's collectives moved where they hold less memory; the same collectives in
the same order on every rank, the same values.

Thunder's FSDP issues every parameter's all-gather at the top of the forward and every gradient's reduce-scatter at
the end of the backward, so all gathered weights, and then all unsharded gradients, are alive at once. Under
activation checkpointing these plateaus are the peak. :func:`schedule_forward` issues each all-gather a few ahead of
its first use; :func:`schedule_backward` reduce-scatters each gradient right after it is made. Only the order of
bound symbols changes; the pipeline keeps the result where the predicted peak is lower.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace

from thunder_fp8shard.analysis.liveness import readers
from thunder_fp8shard.analysis.names import DIVIDE, REDUCE_SCATTER, WAIT
from thunder_fp8shard.analysis.program import ProgramFacts
from thunder_fp8shard.analysis.saved import body_without_dels
from thunder_fp8shard.format import fmt_bytes
from thunder_fp8shard.plan import ShardPlan
from thunder_fp8shard.rewrite.shape import Program, Rewrite

FORWARD_PREFETCH = 8  # about one transformer block's weights


@dataclass(frozen=True)
class Gathered:
    """One parameter all-gathered in the forward: its all-gather, the wait (and unpad slice) making the
    weight, and the weight's first use."""

    gather: BoundSymbol
    chain: tuple[BoundSymbol, ...]
    first_use: int
    at: int  # the all-gather's position


def _outs(b: BoundSymbol) -> list[str]:
    return [p.name for p in b.flat_proxy_outs]


def gathered(facts: ProgramFacts) -> list[Gathered]:
    """The forward's all-gathers of parameter shards whose handle's only use is its wait, with the unpad slice that
    moves with the wait, in order of first use."""
    inputs = {p.name for p in facts.args}
    return sorted((Gathered(g.gather, (g.wait,) if g.unpad is None else (g.wait, g.unpad), g.first_use, g.at)
                   for g in facts.gathers
                   if getattr(g.shard, "name", None) in inputs and g.waited_alone and g.first_use is not None),
                  key=lambda x: (x.first_use, x.at))


def _reordered(trace: TraceCtx, body: Sequence[BoundSymbol], key: dict[int, tuple], provenance: str
               ) -> TraceCtx | None:
    """``trace`` with ``body`` sorted by ``key``; None where the order is the same or a value would be used
    before it is made."""
    from thunder.executors.passes import del_last_used

    order = sorted(body, key=lambda b: key[id(b)])
    if [id(b) for b in order] == [id(b) for b in body]:
        return None
    produced = {name for b in body for name in _outs(b)}
    made = {p.name for b in body for p in b.flat_proxy_args} - produced  # the trace's inputs
    for b in order:
        if any(p.name not in made for p in b.flat_proxy_args):
            return None
        made.update(_outs(b))
    new = from_trace(trace)
    new.bound_symbols = order
    out = del_last_used(new)
    out.set_provenance(TraceProvenance(provenance))
    return out


def schedule_forward(facts: ProgramFacts, prefetch: int = FORWARD_PREFETCH) -> TraceCtx | None:
    """The program's forward with each all-gather issued ``prefetch`` all-gathers ahead of its first use and its wait
    right before that use; None where nothing moves."""
    body, found = facts.body, gathered(facts)
    key: dict[int, tuple] = {id(b): (i, 0, 0) for i, b in enumerate(body)}  # (position, rank, tie)
    for j, x in enumerate(found):
        for k, b in enumerate(x.chain):
            key[id(b)] = (x.first_use, -1, k)  # right before the first use
        if j >= prefetch:  # right before the chain of the one `prefetch` earlier
            key[id(x.gather)] = (found[j - prefetch].first_use, -2, j)
    return _reordered(facts.forward, body, key, f"ShardIntermediates(reschedule): {max(0, len(found) - prefetch)} "
                                                f"of {len(found)} forward all-gathers issued {prefetch} ahead of their use")


def schedule_backward(bw: TraceCtx) -> TraceCtx | None:
    """``bw`` with each gradient's division, reduce-scatter and wait right after the gradient is made; None
    where nothing moves."""
    body = body_without_dels(bw)
    producer: dict[str, int] = {}
    for i, b in enumerate(body):
        for name in _outs(b):
            producer.setdefault(name, i)
    uses = readers(body)
    key: dict[int, tuple] = {id(b): (i, 0, 0) for i, b in enumerate(body)}
    moved = 0
    for i, rs in enumerate(body):
        if rs.sym.name != REDUCE_SCATTER or not rs.args or getattr(rs.args[0], "name", None) not in producer:
            continue
        divided = rs.args[0].name
        div = body[producer[divided]]
        handle = _outs(rs)
        waits = uses.get(handle[0], []) if len(handle) == 1 else []
        grad = div.args[0] if div.args else None
        if (div.sym.name != DIVIDE or uses.get(divided) != [i] or len(waits) != 1 or body[waits[0]].sym.name != WAIT
                or getattr(grad, "name", None) not in producer):
            continue
        at = max(producer[grad.name], *(producer.get(getattr(a, "name", None), -1) for a in div.flat_proxy_args))
        for k, b in enumerate((div, rs, body[waits[0]])):
            key[id(b)] = (at, 1, k)  # right after the gradient (and the divisor) is made
        moved += 1
    return _reordered(bw, body, key, f"ShardIntermediates(reschedule): {moved} gradient reduce-scatters issued and "
                                     "waited for right after their gradient")


# the least predicted gain that keeps a rescheduled program: a smaller one may be the memory model's error
RESCHEDULE_MIN_GAIN = 0.01


def variant(program: Program) -> tuple[TraceCtx, TraceCtx] | None:
    """The forward and the backward with Thunder FSDP's collectives moved (None: nothing moves, or the option is off,
    or this is a variant already)."""
    if not program.options.reschedule or program.variant:
        return None
    fw, bw = schedule_forward(program.facts), schedule_backward(program.facts.backward)
    if fw is None and bw is None:
        return None
    return fw or program.facts.forward, bw or program.facts.backward


def decide(program: Program) -> tuple[dict, tuple[str, ...]]:
    return {"rescheduled": program.variant == "reschedule"}, ()


def keep(program: Program, traces: tuple[TraceCtx, TraceCtx], thunders: ShardPlan,
         rescheduled: ShardPlan) -> str | None:
    """Where the rescheduled program's predicted peak is lower by at least :data:`RESCHEDULE_MIN_GAIN`, the note that
    says so (None: Thunder's order is kept)."""
    if rescheduled.peak_bytes_after > (1 - RESCHEDULE_MIN_GAIN) * thunders.peak_bytes_after:
        return None
    moved = " and ".join(w for w, t, was in (("the forward's all-gathers", traces[0], program.facts.forward),
                                             ("the gradients' reduce-scatters", traces[1], program.facts.backward))
                         if t is not was)
    return (f"reschedule: {moved} moved where they hold less memory (Thunder FSDP's order keeps every gathered "
            f"weight, or every unsharded gradient, alive at once): predicted peak "
            f"{fmt_bytes(thunders.peak_bytes_after)} -> {fmt_bytes(rescheduled.peak_bytes_after)}")


# a variant of the program, planned whole: the pipeline plans both and keeps the lower (``keep``)
RESCHEDULE = Rewrite("reschedule", decide=decide, variant=variant, keep=keep)
