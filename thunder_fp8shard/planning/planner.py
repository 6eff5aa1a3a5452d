"""The planner: decides, for every item the rewrites offer, whether to take it, and says why. ``soundness`` decides
what may be sharded; ``choose`` applies the policy on the memory model (device bytes) and groups the chosen; ``decide``
is the one decision a program, ``make_plan`` the plan's fields it decides. The policies weigh items (:class:`Item`),
whatever rewrite offered them (a sound candidate's shard, a compaction option, the FP8 gather's resized buffers): the
bytes each moves a step, what it changes at each step of the model and what it clashes with, in one evaluator
(``_free``, ``_raising``, ``_greedy``, ``_never_worse``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from thunder_fp8shard.planning import grouping
from thunder_fp8shard.analysis.candidates import Candidate
from thunder_fp8shard.planning.layout import bucket_layout
from thunder_fp8shard.memory.model import MemoryModel
from thunder_fp8shard.options import ShardOptions
from thunder_fp8shard.plan import (
    UNKNOWN, AgreedValue, BudgetTraffic, Bucket, Compaction, Decision, ShardPlan,
)
from thunder_fp8shard.analysis.replication import Replication
from thunder_fp8shard.format import fmt_bytes


@dataclass(frozen=True)
class Analysis:
    """What the planner plans on: the rewrites' sites and the memory model built from their effects."""

    candidates: tuple[Candidate, ...]  # none without a distributed setup
    model: MemoryModel
    replication: Replication | None  # over the setup's whole group
    saved_names: frozenset[str]
    model_io: frozenset[str]  # the caller keeps them alive
    saved_by_dtype: dict[str, int] = field(default_factory=dict)
    sources: Mapping[str, str] = field(default_factory=dict)  # candidate -> the forward input that is its shard
    defaults: frozenset[str] | None = None  # candidates="all": those the default would consider (its choice: a floor)


ONE_RANK = "the shard group has one rank (world size 1, or shard_group_size=1): there is nothing to shard over"


def soundness(
    candidates: list[Candidate], replication: Replication, model_io: set[str], options: ShardOptions, k: int,
    model: MemoryModel, saved_names: set[str], sources: Mapping[str, str] | None = None,
) -> list[Decision]:
    """Marks each candidate sharded if that is sound and frees memory, else gives the reason. ``k``: the shard group's
    size; ``sources``: candidates whose shard is a forward input."""
    sources = sources or {}
    decisions = []
    for c in candidates:
        replicated = replication.is_replicated(c.name)
        life = model.life_of.get(c.name)
        storage = life.nbytes if life is not None else c.payload_bytes
        shard = bucket_layout([c.payload_bytes], k).shard_nbytes if k > 0 else c.payload_bytes
        held = [m for m in life.members if m in model_io] if life is not None else []
        why = None
        if c.name in model_io:
            why = "a model input or output: the caller keeps it alive, sharding frees nothing"
        elif held:
            why = (f"its storage is that of the program's input or output {held[0]} (a view or shallow_copy of it): "
                   "the caller keeps it alive, sharding frees nothing")
        elif not replicated:
            why = f"per-rank: {replication.reason(c.name)}"
        elif k < 2:
            why = ONE_RANK
        elif c.payload_bytes < options.min_bytes:
            why = f"smaller than min_bytes={options.min_bytes}"
        elif c.name not in model.placements:
            why = "not used in backward"
        elif others := sorted(m for m in model.lives[model.placements[c.name].life].members
                              if m != c.name and m in saved_names):
            why = f"shares its storage with saved tensor(s) {', '.join(others)}: sharding it alone frees nothing"
        elif storage <= shard:
            why = (f"a view of a {storage:,} B storage ({c.payload_bytes:,} B as its shape says): the {shard:,} B shard "
                   "sharding keeps would not be smaller than what it frees")
        decisions.append(_decision(c, replicated, k, why, storage, sources.get(c.name, "")))
    return decisions


def decide(analysis: Analysis, options: ShardOptions, k: int, chooser=None) -> Choice:
    """The one decision of a compilation: the policy over every rewrite's items (``chooser``: :func:`choose`, the agreed
    layout's, or a test's). Under ``candidates="all"`` the policy's choice among the default's candidates alone is a
    floor, kept where it predicts a lower peak, or as low with more freed; the plan says where the two differ."""
    chooser = chooser or choose
    sound = [] if analysis.replication is None else soundness(
        list(analysis.candidates), analysis.replication, set(analysis.model_io), options, k, analysis.model,
        set(analysis.saved_names), analysis.sources)
    choice = chooser(sound, analysis.model, options, k)
    if analysis.defaults is None or chooser is not choose or options.policy == "budget":
        return choice
    extras = {d.name for d in sound if d.sharded and d.name not in analysis.defaults}
    floor = choose([replace(d, sharded=False) if d.name in extras else d for d in sound], analysis.model, options, k)
    (peak, freed), (low, most) = _outcome(choice, analysis.model), _outcome(floor, analysis.model)
    nums = f"{peak:,} B and {freed:,} B freed with every candidate, {low:,} B and {most:,} B with the default's alone"
    if (low, -most) < (peak, -freed):  # the floor, the other candidates left out
        why = f"the default's candidates alone predict a lower peak, or as low with more saved freed ({nums})"
        return replace(floor, decisions=[_not_sharded(e, f"left out: {why}") if e.name in extras else e
                                         for e in floor.decisions], notes=[*floor.notes, f'candidates="all": {why}'])
    taken = {d.name for d in choice.decisions if d.sharded}
    if fewer := sorted(d.name for d in floor.decisions if d.sharded and d.name not in taken):
        choice = replace(choice, notes=[*choice.notes, f'candidates="all" leaves out {", ".join(fewer)}, which the '
                                        f"default's candidates alone shard (predicted peak and bytes freed: {nums})"])
    return choice


def _outcome(choice: Choice, model: MemoryModel) -> tuple[int, int]:
    """The predicted peak of ``choice`` and the saved bytes it frees (sharded storages less their shards, and what
    compactions free)."""
    taken = [c for c in choice.compactions if c.compacted]
    freed = (sum(model.life_of[n].nbytes for b in choice.buckets for n in b.members)
             - sum(b.shard_nbytes for b in choice.buckets) + sum(c.freed_bytes for c in taken))
    return int(model.evaluate(choice.buckets, taken, rewritten=choice.resized).peak_bytes), freed


def make_plan(analysis: Analysis, options: ShardOptions, choice: Choice, agreed: Sequence[AgreedValue] = ()) -> dict:
    """The plan's fields the planner's ``choice`` decides for one compilation (``notes`` among them)."""
    model = analysis.model
    buckets, taken, resized = choice.buckets, [c for c in choice.compactions if c.compacted], choice.resized
    # before: without the pass (nor its forward rewrite); after: as the pass runs it
    before, after = model.evaluate(rewritten=False), model.evaluate(buckets, taken, rewritten=resized)
    program_before = model.evaluate(terms=False, rewritten=False)
    program_after = model.evaluate(buckets, taken, terms=False, rewritten=resized)
    life_of = model.life_of
    saved_before = sum(life.nbytes for life in {life_of[n].name: life_of[n] for n in analysis.saved_names}.values())
    saved_after = saved_before - _outcome(choice, model)[1]
    budget = options.budget_bytes if options.policy == "budget" else None
    return dict(
        decisions=tuple(choice.decisions), buckets=tuple(buckets), compactions=tuple(choice.compactions),
        saved_bytes_before=saved_before, saved_bytes_after=saved_after,
        peak_bytes_before=before.peak_bytes, peak_bytes_after=after.peak_bytes,
        program_peak_bytes_before=program_before.peak_bytes, program_peak_bytes_after=program_after.peak_bytes,
        terms=tuple(model.terms), timeline_before=before, timeline_after=after, agreed=tuple(agreed),
        notes=tuple(choice.notes), budget_bytes=budget,
        no_candidates=no_candidates(analysis.saved_by_dtype, options) if analysis.replication is not None
        and not analysis.candidates else "",
        budget_traffic=BudgetTraffic(**choice.traffic) if choice.traffic else None,
        budget_target_bytes=budget_target(budget) if budget is not None else None,
    )


def no_candidates(saved_by_dtype: dict[str, int], options: ShardOptions) -> str:
    """Why a compilation has no candidate, and what would make its saved tensors candidates."""
    if not saved_by_dtype:
        return "no candidates: the forward saves no tensor for backward"
    dtypes = ", ".join(f"{fmt_bytes(n)} {dt}" for dt, n in saved_by_dtype.items())
    words = f"no candidates: the forward saves {dtypes} (each tensor's bytes, by dtype)"
    if options.candidates in ("auto", "fp8"):
        words += (f'; candidates="{options.candidates}" considers float8 tensors (and TransformerEngine\'s quantized '
                  'ones), and under "auto" all-gathered parameters of at least 1 MiB (their shard is an input): '
                  'candidates="all" would consider these, or save FP8 copies of the weights for backward (e.g. from a '
                  'straight-through torch.autograd.Function whose forward saves the float8 weight and whose backward '
                  'upcasts it: docs/fp8_copies.md); a float8 weight upcast in the forward '
                  '(F.linear(x, w.to(float8).to(x.dtype))) saves the upcast copy, not the float8 one')
    return words


@dataclass(frozen=True)
class Choice:
    """What :func:`choose` decided: every candidate's decision, the buckets, every compaction option with its reason,
    the plan's notes and the warnings among them."""

    decisions: list[Decision]
    buckets: list[Bucket]
    compactions: list[Compaction]
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    # policy "budget": the bytes the choice moves a step, and a lower bound for any choice meeting the target
    # (least_traffic)
    traffic: dict | None = None
    resized: tuple[str, ...] = ()  # the resize items taken (the memory model's ``rewritten`` keys)


@dataclass(frozen=True)
class Item:
    """One thing the policies choose among, whichever rewrite offered it: a shard or an own shard (``key``: its
    members), a compaction (its storage) or a resize (the forward rewrite's buffers of one key: the FP8 forward
    gather's), the bytes it moves a step (its run-time cost), what it changes in the live bytes at each step (the span
    it frees, the shard or copy it keeps) and the names it cannot be taken with (``conflicts``: a compaction's storage's
    tensors, whose shard frees that storage instead)."""

    kind: str  # SHARD, OWN_SHARD (its shard is a forward input: nothing kept), COMPACTION or RESIZE
    key: tuple[str, ...]
    moved_bytes: int
    change: np.ndarray
    conflicts: frozenset[str] = frozenset()

    def clashes(self, other: Item) -> bool:
        return bool(self.conflicts.intersection(other.key) or other.conflicts.intersection(self.key))


SHARD, OWN_SHARD, COMPACTION, RESIZE = "shard", "own shard", "compaction", "resize"


def _items(model: MemoryModel, buckets: Sequence[Bucket] = (), compactions: Sequence[Compaction] = ()) -> list[Item]:
    """The items of ``buckets``, then of ``compactions``, in order."""
    return ([Item(OWN_SHARD if b.sources else SHARD, b.members, b.nbytes, model.change([b])) for b in buckets]
            + [Item(COMPACTION, (c.storage,), c.copied_bytes, model.change(compactions=[c]),
                    frozenset(model.lives[c.storage].members)) for c in compactions])


def _free(model: MemoryModel) -> tuple[MemoryModel, tuple[str, ...]]:
    """The model with the resize items every policy takes (those moving no more bytes and holding no more at any step),
    and their keys: the base the policies weigh the other items on."""
    items = [Item(RESIZE, (key,), moved, model.resized({key})) for key, moved in model.resize_moved.items()]
    keys = tuple(i.key[0] for i in items if i.moved_bytes <= 0 and i.change.max() <= 0)
    return replace(model, rewritten=tuple(r for r in model.rewritten if r[0] in keys)), keys


def _instead(items: Sequence[Item], chosen: Sequence[Item]) -> dict[str, str]:
    """Why each of ``items`` not chosen that clashes with a chosen one is left out, by name."""
    why, keys = {}, {c.key for c in chosen}
    for i in items:
        if i.key not in keys and (hits := [c for c in chosen if i.clashes(c)]):
            names = sorted({n for c in hits for n in c.key if n in i.conflicts or c.kind == COMPACTION})
            how = "compacted" if hits[0].kind == COMPACTION else "sharded"
            why.update((n, f"its storage is {how} instead ({', '.join(names)})") for n in i.key)
    return why


def _raising(items: Sequence[Item], base: np.ndarray) -> set[str]:
    """The names (a shard's members, a compaction's storage) of the items that raise the peak of ``base`` on their
    own."""
    return {n for i in items if (base + i.change).max() > base.max() for n in i.key}


def _undone(compactions: Sequence[Compaction], why: Mapping[str, str]) -> list[Compaction]:
    """``compactions``, those whose storage ``why`` names left out with its reason."""
    return [replace(c, compacted=False, reason=why[c.storage]) if c.storage in why else c for c in compactions]


def choose(sound: list[Decision], model: MemoryModel, options: ShardOptions, k: int) -> Choice:
    """Applies the policy to the items of the sound decisions and the compaction options, after the resize items that
    cost nothing (:func:`_free`). A tensor whose gather would follow its shard at once is refused. ``all`` takes each
    item, in order, that does not raise the predicted peak on its own nor clash with one taken before it; ``peak`` and
    ``budget`` take items by peak lowered per byte moved, each leaving out those it clashes with."""
    model, resized = _free(model)
    candidates = [d for d in sound if d.sharded]
    notes: list[str] = []
    warnings: list[str] = []
    sched = dict(prefetch=options.prefetch, k=k)
    singles = grouping.group(candidates, model, bucket_bytes=0, **sched)
    refused = {b.members[0]: "idle interval too short: its all-gather would be issued right after it is sharded"
               for b in singles if model.compute_steps_between(b.shard_at, b.gather_at) == 0}
    candidates = [d for d in candidates if d.name not in refused]
    single_of = {b.members[0]: b for b in singles}
    compactions = _compaction_options(model, options)
    eligible = [c for c in compactions if c.compacted]
    shards, copies = _items(model, [single_of[d.name] for d in candidates]), _items(model, compactions=eligible)
    if options.policy == "all":  # each item on its own: none that raises the predicted peak
        raising, chosen = _raising(shards + copies, model.live_bytes()), []
        for i in shards + copies:
            if not raising.intersection(i.key) and not any(i.clashes(c) for c in chosen):
                chosen.append(i)
        compactions = _undone(compactions, dict.fromkeys(raising, COPY_RAISES))
        refused.update((d.name, RAISES) for d in candidates if d.name in raising)
    else:  # the item lowering the peak most per byte moved, until it stops falling or meets the budget's target
        target = budget_target(options.budget_bytes) if options.policy == "budget" else None
        base, items = model.live_bytes(), copies + shards  # the first of equal gains
        chosen, live = _greedy(items, base, target)
        lowest, names = int(live.max()), {n for i in chosen for n in i.key}
        taken = {i.key[0] for i in chosen if i.kind == COMPACTION}
        met = target is not None and lowest <= target
        refused.update((d.name, LOWERS_NOTHING if not met else NOT_NEEDED) for d in candidates if d.name not in names)
        traffic = {"moved_bytes": sum(i.moved_bytes for i in chosen),
                   "lower_bound_bytes": least_traffic(base, target, items) if target is not None else None}
        if target is not None and not met:  # the best reachable: every sound shard and the compactions beside them
            every = shards + [i for i in copies if not any(i.clashes(s) for s in shards)]
            best = int((base + sum(i.change for i in every)).max())
            if best < lowest:  # closer than the greedy got (no single item lowered the peak alone): take all
                chosen, lowest, met = every, best, best <= target
                taken = {i.key[0] for i in every if i.kind == COMPACTION}
                for d in candidates:
                    refused.pop(d.name, None)
                traffic = {**traffic, "moved_bytes": sum(i.moved_bytes for i in every)}
        compactions = _undone(compactions, {c.storage: NOT_NEEDED if met else LOWERS_NOTHING for c in compactions
                                            if c.compacted and c.storage not in taken})
        if target is not None:
            notes.append(_budget_note(options.budget_bytes, target, model.evaluate([]).peak_bytes, lowest))
            if not met:
                warnings.append(notes[-1])
            if unknown := [t.name for t in model.terms if t.source == UNKNOWN]:
                notes.append(f"the budget was planned on a predicted peak without the {', '.join(unknown)} (unknown "
                             "size): the step can exceed it by that much")
    # an item left out by one it clashes with says so, whatever else kept it out (compact="off" aside)
    instead = _instead(shards + _items(model, compactions=compactions if options.compact != "off" else ()), chosen)
    compactions = _undone(compactions, instead)
    refused.update((n, instead[n]) for n in list(refused) if n in instead)
    final = [d if d.name not in refused else _not_sharded(d, refused[d.name]) for d in sound]
    taken = [c for c in compactions if c.compacted]
    buckets = grouping.group([d for d in final if d.sharded], model, bucket_bytes=options.bucket_bytes,
                             compactions=taken, **sched)
    if options.policy in ("all", "peak"):
        final, compactions, buckets = _never_worse(final, compactions, buckets, model, options, sched,
                                                   lower=options.policy == "peak")
    compactions = [_placed_reason(c, model) for c in grouping.place_compactions(compactions, buckets, model)]
    return Choice(final, buckets, compactions, notes, warnings, traffic if options.policy == "budget" else None,
                  resized)


class LayoutError(RuntimeError):
    """The model's agreed layout cannot be realized in this program."""


NOT_IN_LAYOUT = "not in the model's agreed layout (the ranks agreed what is sharded at its first compilation)"


def choose_layout(sound: list[Decision], model: MemoryModel, options: ShardOptions, k: int, *,
                  buckets: Sequence[Sequence[str]], ops: Sequence[int]) -> Choice:
    """The agreed layout realized here: exactly ``buckets`` sharded by shard ops ``ops``, plus local compactions that do
    not raise the peak. Raises :class:`LayoutError` where a member is not sound here or the order differs; warns where
    it raises this program's peak."""
    model, resized = _free(model)
    by_name = {d.name: d for d in sound}
    members = [n for b in buckets for n in b]
    if missing := [n for n in members if n not in by_name or not by_name[n].sharded]:
        why = by_name[missing[0]].reason if missing[0] in by_name else "not saved for backward here"
        raise LayoutError(f"the agreed layout shards {len(members)} tensor(s); {len(missing)} cannot be sharded "
                          f"in this program (the first, key {missing[0]}: {why})")
    chosen = set(members)
    final = [d if d.name in chosen or not d.sharded else _not_sharded(d, NOT_IN_LAYOUT) for d in sound]
    placed = grouping.place([[by_name[n] for n in b] for b in buckets], list(ops), model, prefetch=options.prefetch,
                            k=k)
    firsts = [b.first_use for b in placed]
    if firsts != sorted(firsts):
        raise LayoutError("the agreed buckets are used in another order in this program's backward")
    compactions = _compaction_options(model, options)  # those not raising the peak on their own nor clashing
    copies = _items(model, compactions=[c for c in compactions if c.compacted])
    raising = _raising(copies, model.live_bytes())
    compactions = _undone(compactions, {**dict.fromkeys(raising, COPY_RAISES), **_instead(
        _items(model, compactions=compactions if options.compact != "off" else ()), _items(model, placed))})
    compactions = [_placed_reason(c, model) for c in grouping.place_compactions(compactions, placed, model)]
    warnings = []
    taken = [c for c in compactions if c.compacted]
    if model.live_bytes(placed, taken).max() > model.live_bytes().max():
        warnings.append("the model's agreed layout raises this program's predicted peak (its shapes are this rank's "
                        "own); the ranks' collectives must stay the same, so it is kept")
    return Choice(final, placed, compactions, list(warnings), warnings, resized=resized)


def _budget_note(budget: int, target: int, before: int, lowest: int) -> str:
    planned = f"planned to {target:,} B (the budget less its {BUDGET_MARGIN:.1%} margin)"
    if before <= target:
        return f"budget {budget:,} B: {planned}; the predicted peak {before:,} B is within it without sharding"
    if lowest <= target:
        return f"budget {budget:,} B: {planned}; predicted peak {lowest:,} B"
    where = "within the budget but not its margin" if lowest <= budget else "over it"
    return (f"budget {budget:,} B cannot be met: {planned}, the best predicted peak reachable (sharding every sound "
            f"candidate and making every compaction, or fewer where more does not lower it) is {lowest:,} B ({where})")


# policy "budget" plans to the budget less this part of it, the memory model's accuracy (docs/memory_model.md)
BUDGET_MARGIN = 0.005


def budget_target(budget_bytes: int) -> int:
    """The predicted peak policy ``budget`` plans to: ``budget_bytes`` less :data:`BUDGET_MARGIN` of it."""
    return budget_bytes - math.ceil(BUDGET_MARGIN * budget_bytes)


def _compaction_options(model: MemoryModel, options: ShardOptions) -> list[Compaction]:
    """The model's compaction options freeing at least ``min_bytes``, each taken where allowed (``compact="auto"``, it
    frees at least what it copies), else with the reason."""
    out = []
    for c in model.compactions:
        if c.freed_bytes < options.min_bytes:
            continue
        if options.compact == "off":
            why = "compact='off'"
        elif c.freed_bytes < c.copied_bytes:
            why = f"it would free {c.freed_bytes:,} B, fewer than the {c.copied_bytes:,} B it copies a step"
        else:
            why = None
        out.append(replace(c, compacted=why is None, reason=why or _compacted_reason(c, model)))
    return out


def _compacted_reason(c: Compaction, model: MemoryModel) -> str:
    return (f"views of {model.lives[c.storage].name}'s {c.storage_nbytes:,} B storage: compact copies free "
            f"{c.freed_bytes:,} B from step {c.compact_at} to the backward, {c.copied_bytes:,} B copied a step")


def _placed_reason(c: Compaction, model: MemoryModel) -> Compaction:
    """A taken compaction's reason, naming the call that makes its copies."""
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


RAISES = "it would raise the predicted peak"
COPY_RAISES = "its copy would raise the predicted peak"
LOWERS_NOTHING = "does not lower the predicted peak"
NOT_NEEDED = "not needed: the budget is met without it"


def _never_worse(decisions: list[Decision], compactions: list[Compaction], buckets: list[Bucket], model: MemoryModel,
                 options: ShardOptions, sched: dict, *, lower: bool
                 ) -> tuple[list[Decision], list[Compaction], list[Bucket]]:
    """The choice as it will run, on the whole model: policy "all" drops what adds most at the peak until it does not
    rise; "peak" until it falls, then anything whose removal leaves it unchanged. Buckets are regrouped after each
    drop."""
    before = int(model.live_bytes().max())
    dropped: dict[str, str] = {}  # shard -> reason
    undone: dict[str, str] = {}  # compaction's storage -> reason
    while True:
        taken = [c for c in compactions if c.compacted and c.storage not in undone]
        live = model.live_bytes(buckets, taken)
        changed = False
        if live.max() > before or (lower and live.max() >= before and (buckets or taken)):
            # the one adding most at the peak goes
            at = int(np.argmax(live))
            most = max(_items(model, buckets, taken), key=lambda i: i.change[at], default=None)
            if most is not None and most.change[at] > 0:
                (undone if most.kind == COMPACTION else dropped).update((n, RAISES) for n in most.key)
            else:  # nothing adds at that step: shard and compact nothing
                why = LOWERS_NOTHING if lower else RAISES
                dropped.update((n, why) for b in buckets for n in b.members)
                undone.update((c.storage, why) for c in taken)
            changed = True
        elif lower:  # drop, one at a time, what leaves the peak unchanged
            for i in _items(model, buckets[::-1], taken):
                if (live - i.change).max() <= live.max():
                    live = live - i.change
                    (undone if i.kind == COMPACTION else dropped).update((n, LOWERS_NOTHING) for n in i.key)
                    changed = True
        if not changed:
            break
        decisions = [d if d.name not in dropped or not d.sharded else _not_sharded(d, dropped[d.name])
                     for d in decisions]
        taken = [c for c in compactions if c.compacted and c.storage not in undone]
        buckets = grouping.group([d for d in decisions if d.sharded], model, bucket_bytes=options.bucket_bytes,
                                 compactions=taken, **sched)
        if lower and not buckets and not taken:
            break
    return decisions, _undone(compactions, undone), buckets


def _greedy(items: Sequence[Item], base: np.ndarray, target: int | None) -> tuple[list[Item], np.ndarray]:
    """Takes the item lowering the peak most per byte moved (the first of equal gains) until the peak stops falling
    (``target`` None) or meets ``target``. Returns the items taken and the live bytes they leave."""
    current, taken, remaining = base, [], list(items)
    while remaining and (target is None or current.max() > target):
        peak = current.max()
        gains = [(peak - (current + i.change).max()) / max(i.moved_bytes, 1) for i in remaining]
        best = int(np.argmax(gains))
        if gains[best] <= 0:
            break
        taken.append(remaining.pop(best))
        current = current + taken[-1].change
        remaining = [i for i in remaining if not i.clashes(taken[-1])]
    return taken, current


def least_traffic(base, target: int, items) -> int | None:
    """A lower bound on the bytes any choice among ``items`` moves to bring the peak to ``target``: each item lowers the
    peak step by a fixed amount, so that step's fractional knapsack bounds every choice. None where all cannot reach
    it."""
    at = int(np.argmax(base))
    need = int(base[at]) - target
    if need <= 0:
        return 0
    gains = sorted(((i.moved_bytes, -int(i.change[at])) for i in items if i.change[at] < 0),
                   key=lambda cg: cg[0] / cg[1])
    bound = 0.0
    for cost, gain in gains:
        take = min(1.0, need / gain)
        bound += take * cost
        need -= take * gain
        if need <= 0:
            return int(math.ceil(bound))
    return None


def _not_sharded(d: Decision, why: str) -> Decision:
    """``d`` left out after all, with why: nothing of its shard remains."""
    return replace(d, sharded=False, shard_nbytes=0, shard_source="", reason=why)


def _decision(c: Candidate, replicated: bool, k: int, refused: str | None, storage_nbytes: int,
              source: str = "") -> Decision:
    view = (f"; a view of a {storage_nbytes:,} B storage, which sharding frees" if storage_nbytes != c.payload_bytes
            else "")
    kept = (f"its shard is {source}, this rank's rows the forward all-gathered it from: nothing copied or kept"
            if source else f"rank keeps 1/{k}")
    return Decision(
        name=c.name, shape=tuple(int(s) for s in c.proxy.shape), dtype=str(c.proxy.dtype).removeprefix("thunder.dtypes."),
        kind=c.kind, nbytes=c.payload_bytes, replicated=replicated, sharded=refused is None,
        reason=refused or f"identical on every rank; {kept}{view}",
        shard_nbytes=bucket_layout([c.payload_bytes], k).shard_nbytes if refused is None else 0,
        storage_nbytes=storage_nbytes, shard_source=source if refused is None else "",
    )
