"""The planner: decides, for every candidate, whether to shard it, and says why. Pure functions over plain data.

``soundness`` decides what *may* be sharded (replicated, worth a collective, freeing its storage);
``schedule`` groups the sharded tensors into buckets (one all-gather each) and shard ops (see
:mod:`thunder_fp8shard.grouping`) and places each bucket's shard point, all-gather and first use on the joint
timeline; ``choose`` applies the policy (all sound candidates, only those lowering the predicted peak, or the least
all-gather traffic meeting a byte budget) by evaluating the memory model (:mod:`thunder_fp8shard.memory_model`:
the program's storages plus the memory the step runs in), so that peaks and budgets are device bytes.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from thunder_fp8shard import grouping
from thunder_fp8shard.candidates import Candidate
from thunder_fp8shard.layout import bucket_layout
from thunder_fp8shard.liveness import life_spans, span_bytes, with_sharding
from thunder_fp8shard.memory_model import MemoryModel
from thunder_fp8shard.options import ShardOptions
from thunder_fp8shard.plan import UNKNOWN, Bucket, Decision
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
    chosen: list[Decision], model: MemoryModel, *, prefetch: int, bucket_bytes: int, world_size: int
) -> list[Bucket]:
    """Buckets and shard ops of the chosen tensors, as :mod:`thunder_fp8shard.rewrite` will build them: grouped on the
    memory model by :func:`thunder_fp8shard.grouping.group` (one tensor a bucket when ``bucket_bytes`` is 0)."""
    return grouping.group(chosen, model, prefetch=prefetch, bucket_bytes=bucket_bytes, world_size=world_size)


def choose(
    sound: list[Decision], model: MemoryModel, options: ShardOptions, world_size: int
) -> tuple[list[Decision], list[Bucket], list[str]]:
    """Applies the policy to the sound decisions; returns the final decisions, their buckets and notes for the plan.

    A tensor whose own all-gather (``prefetch`` tensors ahead) would come right after its shard is refused.
    Policies ``peak`` and ``budget`` weigh each tensor on its own (its own shard and gather, as just placed); the
    buckets are formed from what is kept, and the plan's prediction is made with those buckets.
    """
    candidates = [d for d in sound if d.sharded]
    refused: dict[str, str] = {}
    notes: list[str] = []
    sched = dict(prefetch=options.prefetch, world_size=world_size)
    singles = schedule(candidates, model, bucket_bytes=0, **sched)
    for b in singles:
        if model.compute_steps_between(b.shard_at, b.gather_at) == 0:
            refused[b.members[0]] = "idle interval too short: its all-gather would be issued right after it is sharded"
    candidates = [d for d in candidates if d.name not in refused]
    if options.policy != "all":
        target = options.budget_bytes if options.policy == "budget" else None
        notes = _greedy(candidates, model, singles, target, refused)
        unknown = [t.name for t in model.terms if t.source == UNKNOWN]
        if target is not None and unknown:
            notes.append(f"the budget was planned on a predicted peak without the {', '.join(unknown)} (unknown "
                         "size): the step can exceed it by that much")
    final = [d if d.name not in refused else replace(d, sharded=False, shard_nbytes=0, reason=refused[d.name]) for d in sound]
    buckets = schedule([d for d in final if d.sharded], model, bucket_bytes=options.bucket_bytes, **sched)
    return final, buckets, notes


def _greedy(candidates, model: MemoryModel, singles: list[Bucket], target, refused) -> list[str]:
    """Adds, one at a time, the candidate that lowers the predicted peak most per byte it will all-gather, until the
    peak stops falling (policy "peak") or reaches ``target`` (policy "budget"). Each candidate's effect is taken
    with its own gather placement in ``singles`` (one bucket per tensor); fills ``refused`` and returns notes."""
    steps = model.steps
    base = np.array(model.evaluate([]).live_bytes, dtype=np.int64)
    deltas = {}
    for b in singles:
        (name,) = b.members
        if name in refused:
            continue
        group = model.sharded_group(b)
        alone = {life: model.lives[life] for life in group.lives}
        sharded = with_sharding(alone, steps, [group])
        deltas[name] = (span_bytes(life_spans(sharded.values()), len(steps))
                        - span_bytes(life_spans(alone.values()), len(steps)))
    current, notes = base, []
    if target is not None and current.max() <= target:
        notes.append(f"the predicted peak {current.max():,} B is already within the budget {target:,} B")
    remaining = list(candidates)
    while remaining and (target is None or current.max() > target):
        peak = current.max()
        gains = [(peak - (current + deltas[d.name]).max()) / d.nbytes for d in remaining]
        best = int(np.argmax(gains))
        if gains[best] <= 0:
            break
        current = current + deltas[remaining.pop(best).name]
    met = target is not None and current.max() <= target
    for d in remaining:
        refused[d.name] = "not needed: the budget is met without it" if met else "does not lower the predicted peak"
    if target is not None and not met:
        notes.append(f"budget {target:,} B cannot be met: the lowest predicted peak is {current.max():,} B")
    return notes


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
