"""The planner: decides, for every candidate, whether to shard it, and says why. Pure functions over plain data.

``soundness`` decides what *may* be sharded (replicated, worth a collective, freeing its storage);
``schedule`` groups the sharded tensors into buckets (one all-gather each) and shard ops (see
:mod:`thunder_fp8shard.grouping`) and places each bucket's shard point, all-gather and first use on the joint
timeline; ``choose`` applies the policy (all sound candidates, only those lowering the predicted peak, or the least
all-gather traffic meeting a byte budget) by evaluating the memory model (:mod:`thunder_fp8shard.memory_model`:
the program's storages plus the memory the step runs in), so that peaks and budgets are device bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from thunder_fp8shard import grouping
from thunder_fp8shard.candidates import Candidate
from thunder_fp8shard.layout import bucket_layout
from thunder_fp8shard.liveness import life_spans, span_bytes, with_compaction, with_sharding
from thunder_fp8shard.memory_model import MemoryModel, compacted_storage
from thunder_fp8shard.options import ShardOptions
from thunder_fp8shard.plan import UNKNOWN, Bucket, Compaction, Decision
from thunder_fp8shard.replication import Replication


ONE_RANK = "the shard group has one rank (world size 1, or shard_group_size=1): there is nothing to shard over"


def soundness(
    candidates: list[Candidate], replication: Replication, model_io: set[str], options: ShardOptions, world_size: int,
    model: MemoryModel, saved_names: set[str],
) -> list[Decision]:
    """Marks each candidate sharded if sharding it is sound and frees memory; otherwise gives the reason.
    ``world_size``: the ranks each tensor is sharded over (the shard group's, see
    :mod:`thunder_fp8shard.shard_groups`); ``replication`` is over the setup's whole group."""
    decisions = []
    for c in candidates:
        replicated = replication.is_replicated(c.name)
        why = None
        if c.name in model_io:
            why = "a model input or output: the caller keeps it alive, sharding frees nothing"
        elif not replicated:
            why = f"per-rank: {replication.reason(c.name)}"
        elif world_size < 2:
            why = ONE_RANK
        elif c.payload_bytes < options.min_bytes:
            why = f"smaller than min_bytes={options.min_bytes}"
        elif c.name not in model.placements:
            why = "not used in backward"
        elif others := _storage_sharers(c, model, saved_names):
            why = f"shares its storage with saved tensor(s) {', '.join(others)}: sharding it alone frees nothing"
        decisions.append(_decision(c, replicated, world_size, why))
    return decisions


def schedule(
    chosen: list[Decision], model: MemoryModel, *, prefetch: int, bucket_bytes: int, world_size: int,
    compactions: list[Compaction] = (),
) -> list[Bucket]:
    """Buckets and shard ops of the chosen tensors, as :mod:`thunder_fp8shard.rewrite` will build them: grouped on the
    memory model (with ``compactions`` made) by :func:`thunder_fp8shard.grouping.group` (one tensor a bucket when
    ``bucket_bytes`` is 0)."""
    return grouping.group(chosen, model, prefetch=prefetch, bucket_bytes=bucket_bytes, world_size=world_size,
                          compactions=compactions)


@dataclass(frozen=True)
class Choice:
    """What :func:`choose` decided: every candidate's decision, the buckets of the sharded ones, every compaction
    option (taken or not, with the reason), the plan's notes, and those of them the user must be warned of."""

    decisions: list[Decision]
    buckets: list[Bucket]
    compactions: list[Compaction]
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def choose(sound: list[Decision], model: MemoryModel, options: ShardOptions, world_size: int) -> Choice:
    """Applies the policy to the sound decisions and the model's compaction options.

    A tensor whose own all-gather (``prefetch`` tensors ahead) would come right after its shard is refused.
    Policies ``peak`` and ``budget`` weigh each tensor on its own (its own shard and gather, as just placed) and each
    compaction on its own, by the predicted peak each lowers per byte it moves a step (a shard's payload is
    all-gathered back, a compaction's copy is made); the buckets are formed from what is kept, and the plan's
    prediction is made with those buckets and compactions. ``budget`` plans to the budget less
    :data:`BUDGET_MARGIN` of it (:func:`budget_target`).
    """
    candidates = [d for d in sound if d.sharded]
    refused: dict[str, str] = {}
    notes: list[str] = []
    warnings: list[str] = []
    sched = dict(prefetch=options.prefetch, world_size=world_size)
    singles = schedule(candidates, model, bucket_bytes=0, **sched)
    for b in singles:
        if model.compute_steps_between(b.shard_at, b.gather_at) == 0:
            refused[b.members[0]] = "idle interval too short: its all-gather would be issued right after it is sharded"
    candidates = [d for d in candidates if d.name not in refused]
    compactions = _compaction_options(model, sound, options)
    eligible = [c for c in compactions if c.compacted]
    if options.policy == "all":
        compactions = _not_raising_the_peak(compactions, model)
    else:
        target = budget_target(options.budget_bytes) if options.policy == "budget" else None
        taken, lowest = _greedy(candidates, eligible, model, singles, target, refused)
        met = target is not None and lowest <= target
        left_out = "not needed: the budget is met without it" if met else "does not lower the predicted peak"
        compactions = [c if not c.compacted or c.storage in taken else replace(c, compacted=False, reason=left_out)
                       for c in compactions]
        if target is not None:
            notes.append(_budget_note(options.budget_bytes, target, model.evaluate([]).peak_bytes, lowest))
            if not met:
                warnings.append(notes[-1])
        unknown = [t.name for t in model.terms if t.source == UNKNOWN]
        if target is not None and unknown:
            notes.append(f"the budget was planned on a predicted peak without the {', '.join(unknown)} (unknown "
                         "size): the step can exceed it by that much")
    final = [d if d.name not in refused else replace(d, sharded=False, shard_nbytes=0, reason=refused[d.name]) for d in sound]
    taken = [c for c in compactions if c.compacted]
    buckets = schedule([d for d in final if d.sharded], model, bucket_bytes=options.bucket_bytes, compactions=taken,
                       **sched)
    return Choice(final, buckets, compactions, notes, warnings)


def _budget_note(budget: int, target: int, before: int, lowest: int) -> str:
    planned = f"planned to {target:,} B (the budget less its {BUDGET_MARGIN:.0%} margin)"
    if before <= target:
        return f"budget {budget:,} B: {planned}; the predicted peak {before:,} B is within it without sharding"
    if lowest <= target:
        return f"budget {budget:,} B: {planned}; predicted peak {lowest:,} B"
    where = "within the budget but not its margin" if lowest <= budget else "over it"
    return f"budget {budget:,} B cannot be met: {planned}, the lowest predicted peak is {lowest:,} B ({where})"


BUDGET_MARGIN = 0.02  # policy "budget" plans to the budget less this part of it: the memory model's accuracy on the device


def budget_target(budget_bytes: int) -> int:
    """The predicted peak policy ``budget`` plans to: ``budget_bytes`` less :data:`BUDGET_MARGIN` of it."""
    return budget_bytes - math.ceil(BUDGET_MARGIN * budget_bytes)


def _compaction_options(model: MemoryModel, sound: list[Decision], options: ShardOptions) -> list[Compaction]:
    """The model's compaction options freeing at least ``min_bytes``, each marked taken where it may be (``compact``
    is ``"auto"``, it frees at least as many bytes as it copies, and no tensor of its storage is a sharding
    candidate), else with the reason."""
    sharding = {d.name for d in sound if d.sharded}
    out = []
    for c in model.compactions:
        if c.freed_bytes < options.min_bytes:
            continue
        shared = sorted(sharding.intersection(model.lives[c.storage].members))
        if options.compact == "off":
            why = "compact='off'"
        elif shared:
            why = f"its storage is sharded instead ({', '.join(shared)})"
        elif c.freed_bytes < c.copied_bytes:
            why = f"it would free {c.freed_bytes:,} B, fewer than the {c.copied_bytes:,} B it copies a step"
        else:
            why = None
        out.append(replace(c, compacted=why is None, reason=why or _compacted_reason(c, model)))
    return out


def _compacted_reason(c: Compaction, model: MemoryModel) -> str:
    base = model.lives[c.storage]
    return (f"views of {base.name}'s {c.storage_nbytes:,} B storage: compact copies free {c.freed_bytes:,} B from "
            f"step {c.compact_at} to the backward, {c.copied_bytes:,} B copied a step")


def _not_raising_the_peak(compactions: list[Compaction], model: MemoryModel) -> list[Compaction]:
    """Policy "all": every eligible compaction that does not raise the predicted peak on its own."""
    base = np.array(model.evaluate([]).live_bytes, dtype=np.int64)
    out = []
    for c in compactions:
        if c.compacted and (base + _compaction_delta(model, c)).max() > base.max():
            c = replace(c, compacted=False, reason="its copy would raise the predicted peak")
        out.append(c)
    return out


def _compaction_delta(model: MemoryModel, c: Compaction) -> np.ndarray:
    n = len(model.steps)
    alone = {c.storage: model.lives[c.storage]}
    after = with_compaction(alone, [compacted_storage(c)])
    return span_bytes(life_spans(after.values()), n) - span_bytes(life_spans(alone.values()), n)


def _greedy(candidates, compactions: list[Compaction], model: MemoryModel, singles: list[Bucket], target, refused
            ) -> tuple[set[str], int]:
    """Adds, one at a time, the shard or compaction that lowers the predicted peak most per byte it moves a step (a
    shard: its payload, all-gathered back; a compaction: its copy; compactions first where equal), until the peak
    stops falling (policy "peak") or reaches ``target`` (policy "budget"). Each shard's effect is taken with its
    own gather placement in ``singles`` (one bucket per tensor). Fills ``refused`` with the shards left out; returns
    the storages of the compactions taken and the predicted peak reached."""
    steps = model.steps
    base = np.array(model.evaluate([]).live_bytes, dtype=np.int64)
    items = [(c.storage, c.copied_bytes, _compaction_delta(model, c), "compaction") for c in compactions]
    for b in singles:
        (name,) = b.members
        if name in refused:
            continue
        group = model.sharded_group(b)
        alone = {life: model.lives[life] for life in group.lives}
        sharded = with_sharding(alone, steps, [group])
        delta = span_bytes(life_spans(sharded.values()), len(steps)) - span_bytes(life_spans(alone.values()), len(steps))
        items.append((name, next(d.nbytes for d in candidates if d.name == name), delta, "shard"))
    current, taken = base, set()
    remaining = [it for it in items if it[3] == "compaction" or any(d.name == it[0] for d in candidates)]
    while remaining and (target is None or current.max() > target):
        peak = current.max()
        gains = [(peak - (current + delta).max()) / max(cost, 1) for _, cost, delta, _ in remaining]
        best = int(np.argmax(gains))
        if gains[best] <= 0:
            break
        name, _, delta, _ = remaining.pop(best)
        current = current + delta
        taken.add(name)
    met = target is not None and current.max() <= target
    for name, _, _, kind in remaining:
        if kind == "shard":
            refused[name] = "not needed: the budget is met without it" if met else "does not lower the predicted peak"
    return taken, int(current.max())


def _storage_sharers(c: Candidate, model: MemoryModel, saved_names: set[str]) -> list[str]:
    life = model.lives[model.placements[c.name].life]
    return sorted(m for m in life.members if m != c.name and m in saved_names)


def _decision(c: Candidate, replicated: bool, world_size: int, refused: str | None) -> Decision:
    return Decision(
        name=c.name, shape=tuple(int(s) for s in c.proxy.shape), dtype=str(c.proxy.dtype).removeprefix("thunder.dtypes."),
        kind=c.kind, nbytes=c.payload_bytes, replicated=replicated, sharded=refused is None,
        reason=refused or f"identical on every rank; rank keeps 1/{world_size}",
        shard_nbytes=bucket_layout([c.payload_bytes], world_size).shard_nbytes if refused is None else 0,
    )
