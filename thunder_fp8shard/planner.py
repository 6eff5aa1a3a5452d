"""The planner: decides, for every candidate, whether to shard it, and says why. Pure functions over plain data.

``soundness`` decides what *may* be sharded (replicated, worth a collective, freeing its storage); ``choose``
applies the policy to the sound candidates and the compaction options (all of them, only those lowering the
predicted peak, or the fewest bytes moved that meet a byte budget) by asking the memory model
(:mod:`thunder_fp8shard.memory_model`: the program's storages plus the memory the step runs in), so that peaks and
budgets are device bytes, and has the chosen tensors grouped into buckets and shard ops
(:mod:`thunder_fp8shard.grouping`); ``make_plan`` is the pure entry point: from the analysis and the agreed inputs,
the plan (the choice, its evaluations, the byte accounting).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from thunder_fp8shard import grouping
from thunder_fp8shard.analysis import Analysis
from thunder_fp8shard.candidates import Candidate
from thunder_fp8shard.liveness import storage_of
from thunder_fp8shard.layout import bucket_layout
from thunder_fp8shard.memory_model import MemoryModel
from thunder_fp8shard.options import ShardOptions
from thunder_fp8shard.plan import UNKNOWN, AgreedValue, Bucket, Compaction, Decision, ShardPlan
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


def make_plan(analysis: Analysis, options: ShardOptions, world_size: int, header: ShardPlan,
              agreed: Sequence[AgreedValue] = ()) -> tuple[ShardPlan, list[str]]:
    """The plan of one compilation (pure): ``analysis`` with the memory terms every rank agreed on, ``options`` with
    the agreed budget, ``world_size`` the ranks each tensor is sharded over (the shard group's), ``header`` the plan's
    setup facts (an empty :class:`ShardPlan`: integration, shard group, notes), ``agreed`` what was agreed. Returns
    the plan (the choice, its predicted timelines before and after, its byte accounting) and the warnings to give."""
    model = analysis.model
    sound = []
    if analysis.replication is not None:
        sound = soundness(list(analysis.candidates), analysis.replication, set(analysis.model_io), options, world_size,
                          model, set(analysis.saved_names))
    choice = choose(sound, model, options, world_size)
    buckets, taken = choice.buckets, [c for c in choice.compactions if c.compacted]
    before, after = model.evaluate(), model.evaluate(buckets, taken)
    program_before, program_after = model.evaluate(terms=False), model.evaluate(buckets, taken, terms=False)
    life_of = storage_of(model.lives)
    saved_before = sum(life.nbytes for life in {life_of[n].name: life_of[n] for n in analysis.saved_names}.values())
    saved_after = (saved_before - sum(life_of[n].nbytes for b in buckets for n in b.members)
                   + sum(b.shard_nbytes for b in buckets) - sum(c.freed_bytes for c in taken))
    budget = options.budget_bytes if options.policy == "budget" else None
    plan = replace(
        header, decisions=choice.decisions, buckets=buckets, compactions=choice.compactions,
        saved_bytes_before=saved_before, saved_bytes_after=saved_after,
        peak_bytes_before=before.peak_bytes, peak_bytes_after=after.peak_bytes,
        program_peak_bytes_before=program_before.peak_bytes, program_peak_bytes_after=program_after.peak_bytes,
        terms=list(model.terms), timeline_before=before, timeline_after=after, agreed=list(agreed),
        notes=[*header.notes, *choice.notes], budget_bytes=budget, budget_traffic=choice.traffic,
        budget_target_bytes=budget_target(budget) if budget is not None else None,
    )
    return plan, choice.warnings


@dataclass(frozen=True)
class Choice:
    """What :func:`choose` decided: every candidate's decision, the buckets of the sharded ones, every compaction
    option (taken or not, with the reason), the plan's notes, and those of them the user must be warned of."""

    decisions: list[Decision]
    buckets: list[Bucket]
    compactions: list[Compaction]
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    # policy "budget": the bytes the choice moves a step (shards' payloads, compactions' copies) and a lower bound on
    # what any choice meeting the budget's target must move (see least_traffic)
    traffic: dict | None = None


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
    singles = grouping.group(candidates, model, bucket_bytes=0, **sched)
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
        taken, lowest, traffic = _greedy(candidates, eligible, model, singles, target, refused)
        met = target is not None and lowest <= target
        if target is not None and not met:  # the best reachable: every sound shard and every eligible compaction
            names = {d.name for d in candidates}
            every = [b for b in singles if b.members[0] in names]
            best = int((model.live_bytes() + model.change(every, eligible)).max())
            if best < lowest:  # closer than the greedy got (no single item lowered the peak on its own): take all
                taken, lowest, met = {c.storage for c in eligible}, best, best <= target
                for d in candidates:
                    refused.pop(d.name, None)
                traffic = {**traffic, "moved_bytes": sum(d.nbytes for d in candidates)
                           + sum(c.copied_bytes for c in eligible)}
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
    buckets = grouping.group([d for d in final if d.sharded], model, bucket_bytes=options.bucket_bytes,
                             compactions=taken, **sched)
    compactions = [_placed_reason(c, model) for c in grouping.place_compactions(compactions, buckets, model)]
    return Choice(final, buckets, compactions, notes, warnings, traffic if options.policy == "budget" else None)


def _budget_note(budget: int, target: int, before: int, lowest: int) -> str:
    planned = f"planned to {target:,} B (the budget less its {BUDGET_MARGIN:.1%} margin)"
    if before <= target:
        return f"budget {budget:,} B: {planned}; the predicted peak {before:,} B is within it without sharding"
    if lowest <= target:
        return f"budget {budget:,} B: {planned}; predicted peak {lowest:,} B"
    where = "within the budget but not its margin" if lowest <= budget else "over it"
    return (f"budget {budget:,} B cannot be met: {planned}, the best predicted peak reachable (sharding every sound "
            f"candidate and making every compaction, or fewer where more does not lower it) is {lowest:,} B ({where})")


# policy "budget" plans to the budget less this part of it: the memory model predicts the device peak within about
# 0.3% at 32 layers and 0.5% at 8 (README, "How accurate it is on the device"), so a met budget ends within 0.5% of it
BUDGET_MARGIN = 0.005


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


def _placed_reason(c: Compaction, model: MemoryModel) -> Compaction:
    """A taken compaction's reason, saying which call makes its copies where :func:`grouping.place_compactions`
    moved them."""
    if not c.compacted:
        return c
    reason = _compacted_reason(c, model)
    if c.shard_op is not None:
        reason += f"; made by shard op {c.shard_op}'s call"
    elif c.moved_from is not None:
        reason += f"; made in one call with the other compactions at step {c.compact_at}"
    if c.moved_from is not None:
        reason += (f" (moved from step {c.moved_from}, its storage's last forward use: the predicted peak does not "
                   "rise)")
    return replace(c, reason=reason)


def _not_raising_the_peak(compactions: list[Compaction], model: MemoryModel) -> list[Compaction]:
    """Policy "all": every eligible compaction that does not raise the predicted peak on its own."""
    base = model.live_bytes()
    out = []
    for c in compactions:
        if c.compacted and (base + model.change(compactions=[c])).max() > base.max():
            c = replace(c, compacted=False, reason="its copy would raise the predicted peak")
        out.append(c)
    return out


def _greedy(candidates, compactions: list[Compaction], model: MemoryModel, singles: list[Bucket], target, refused
            ) -> tuple[set[str], int, dict]:
    """Adds, one at a time, the shard or compaction that lowers the predicted peak most per byte it moves a step (a
    shard: its payload, all-gathered back; a compaction: its copy; compactions first where equal), until the peak
    stops falling (policy "peak") or reaches ``target`` (policy "budget"). Each shard's effect is taken with its
    own gather placement in ``singles`` (one bucket per tensor). Fills ``refused`` with the shards left out; returns
    the storages of the compactions taken, the predicted peak reached, and the traffic (:func:`least_traffic`)."""
    base = model.live_bytes()
    single = {b.members[0]: b for b in singles}
    # compactions first, then the shards in the candidates' order: the first of equal gains is taken
    items = [(c.storage, c.copied_bytes, model.change(compactions=[c]), "compaction") for c in compactions]
    items += [(d.name, d.nbytes, model.change([single[d.name]]), "shard") for d in candidates]
    current, taken, moved = base, set(), 0
    remaining = list(items)
    while remaining and (target is None or current.max() > target):
        peak = current.max()
        gains = [(peak - (current + delta).max()) / max(cost, 1) for _, cost, delta, _ in remaining]
        best = int(np.argmax(gains))
        if gains[best] <= 0:
            break
        name, cost, delta, kind = remaining.pop(best)
        current = current + delta
        moved += cost
        if kind == "compaction":
            taken.add(name)
    met = target is not None and current.max() <= target
    for name, _, _, kind in remaining:
        if kind == "shard":
            refused[name] = "not needed: the budget is met without it" if met else "does not lower the predicted peak"
    traffic = {"moved_bytes": moved, "lower_bound_bytes": least_traffic(base, target, items) if target is not None
               else None}
    return taken, int(current.max()), traffic


def least_traffic(base, target: int, items) -> int | None:
    """A lower bound on the bytes a step any choice among ``items`` (``(name, bytes moved, change, kind)``) must
    move to bring the predicted peak ``base`` to ``target``: at the step where the peak is, each item lowers the live
    bytes by a fixed amount, and every choice meeting the target must lower that step by ``peak - target`` at least;
    the fractional knapsack of that one step (the cheapest bytes per byte lowered first, the last taken in part) is a
    bound no choice beats. None where even every item together cannot lower that step enough."""
    at = int(np.argmax(base))
    need = int(base[at]) - target
    if need <= 0:
        return 0
    gains = sorted(((cost, -int(delta[at])) for _, cost, delta, _ in items if delta[at] < 0),
                   key=lambda cg: cg[0] / cg[1])
    bound = 0.0
    for cost, gain in gains:
        take = min(1.0, need / gain)
        bound += take * cost
        need -= take * gain
        if need <= 0:
            return int(math.ceil(bound))
    return None


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
