"""Which sharded tensors travel together: buckets (one all-gather each) and shard ops (one forward op keeping the shards
of consecutive buckets). Larger groups cost the CPU less but hold more bytes at once. In order of first backward use, a
tensor joins the current bucket only within ``bucket_bytes``, with compute left to hide the gather, and where the model
predicts any extra bytes stay :data:`HEADROOM` below the peak. A shard op holds its members' full copies only until it
runs, not a gathered buffer, so shard ops merge on their own terms: no ``bucket_bytes``, and extra bytes only where the
model predicts :data:`MODEL_ACCURACY` of the peak to spare; each refused merge says why (:data:`STOPS`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from thunder_fp8shard.planning.layout import bucket_layout, packed_offsets, sources_layout
from thunder_fp8shard.memory.model import MemoryModel
from thunder_fp8shard.plan import Bucket, Compaction, Decision

HEADROOM = 0.05  # a bucket merge may add bytes only where the model predicts this fraction of its peak to spare
# a shard-op merge may add bytes only where the model predicts this fraction of its peak to spare: the memory model's
# error on the device, predicted less measured peak (benchmarks/plan_accuracy.py; Llama-2-7b, 32 layers, the defaults:
# FP8 -0.29%, bf16 +0.07%, benchmarks/results/h100_2026-12-05/s*/paired/*_accuracy_default.json, docs/memory_model.md)
MODEL_ACCURACY = 0.003
PEAK, BETWEEN, INPUT = "the predicted peak", "no compute between", "a forward-input shard"
STOPS = (PEAK, BETWEEN, INPUT)  # why a shard op did not take the next bucket (Bucket.merge_stop)


def prefetched_by(j: int, prefetch: int) -> int | None:
    """The bucket at whose first backward use bucket ``j``'s all-gather is issued (None: the backward's start); the one
    rule for plan and rewrite."""
    return j - prefetch if j >= prefetch else None


def place(buckets: Sequence[Sequence[Decision]], ops: Sequence[int], model: MemoryModel, *, prefetch: int, k: int
          ) -> list[Bucket]:
    """The :class:`Bucket`\\ s of a grouping (``buckets``: members, in order of first backward use; ``ops[j]``: bucket
    ``j``'s shard op). A shard op runs after its members' last forward use and is held until its last bucket's wait."""
    placements = model.placements
    first_uses = [placements[b[0].name].first_use for b in buckets]
    layouts = [_layout(b, k) for b in buckets]
    shard_at: dict[int, int] = {}
    until: dict[int, int] = {}
    members_of: dict[int, list[int]] = {}
    for j, op in enumerate(ops):
        shard_at[op] = max(shard_at.get(op, -1), *(placements[d.name].shard_at for d in buckets[j]))
        until[op] = max(until.get(op, -1), first_uses[j])
        members_of.setdefault(op, []).append(j)
    offsets = {j: offset for js in members_of.values()
               for j, offset in zip(js, packed_offsets([layouts[j].shard_nbytes for j in js])[0])}
    return [
        Bucket(
            index=j, members=tuple(d.name for d in b), nbytes=sum(d.nbytes for d in b),
            shard_nbytes=layouts[j].shard_nbytes, gathered_nbytes=layouts[j].gathered_nbytes,
            shard_at=shard_at[ops[j]], first_use=first_uses[j],
            gather_at=model.backward_body_start if (src := prefetched_by(j, prefetch)) is None else first_uses[src],
            shard_op=ops[j], shard_offset=offsets[j], shard_until=until[ops[j]],
            sources=tuple(d.shard_source for d in b) if all(d.shard_source for d in b) else (),
        )
        for j, b in enumerate(buckets)
    ]


class _Sizes(NamedTuple):
    shard_nbytes: int
    gathered_nbytes: int


def _layout(bucket: Sequence[Decision], k: int) -> _Sizes:
    """A bucket's bytes per rank and gathered (coalesced where every member's shard is a forward input)."""
    if all(d.shard_source for d in bucket):
        return _Sizes(sum(d.nbytes // k for d in bucket), sources_layout([d.nbytes for d in bucket]).nbytes)
    lay = bucket_layout([d.nbytes for d in bucket], k)
    return _Sizes(lay.shard_nbytes, lay.gathered_nbytes)


def group(chosen: Sequence[Decision], model: MemoryModel, *, prefetch: int, bucket_bytes: int, k: int,
          compactions: Sequence[Compaction] = ()) -> list[Bucket]:
    """Buckets and shard ops for the chosen tensors; ``bucket_bytes=0``: one tensor a bucket, one bucket a shard op."""
    order = sorted(chosen, key=lambda d: model.placements[d.name].first_use)
    singles = [[d] for d in order]
    build = lambda bs, ops: place(bs, ops, model, prefetch=prefetch, k=k)  # noqa: E731
    if bucket_bytes == 0 or len(order) < 2:
        return build(singles, range(len(singles)))
    base = model.live_bytes(compactions=compactions)  # the compactions made, nothing sharded
    live_bytes = lambda trial: base + model.change(trial)  # noqa: E731
    reference = live_bytes(build(singles, range(len(singles))))
    ceiling = (1 - HEADROOM) * reference.max()

    def bucket_stop(run, parts) -> str | None:  # tensors whose shards are forward inputs travel apart (one all-gather)
        if sum(d.nbytes for d in run) > bucket_bytes or len({bool(d.shard_source) for d in run}) > 1:
            return "bucket_bytes or a forward-input shard"
        trial = build([[d for b in p for d in b] for p in parts], range(len(parts)))
        return None if _idle_everywhere(trial, model) and _free(live_bytes(trial), reference, ceiling) else PEAK

    buckets, _ = _grow(singles, bucket_stop)
    merged = [[d for b in p for d in b] for p in buckets]
    # shard ops: consecutive buckets whose shards one op keeps, where the peak does not rise (their full copies are held
    # until the op runs, its shard until its last bucket's wait)
    ops_of = lambda parts: [op for op, p in enumerate(parts) for j in p for _ in j]  # noqa: E731
    alone = live_bytes(build(merged, range(len(merged))))
    margin = (1 - MODEL_ACCURACY) * alone.max()

    def op_stop(run, parts) -> str | None:  # a bucket whose shards are forward inputs has no shard op
        if any(d.shard_source for j in run for d in merged[j]):
            return INPUT
        if not _idle_everywhere(trial := build(merged, ops_of(parts)), model):
            return BETWEEN
        return None if _free(live_bytes(trial), alone, margin) else PEAK

    by_op, stops = _grow([[j] for j in range(len(merged))], op_stop)
    firsts = {sum(map(len, by_op[:i])): why for i, why in enumerate(stops, 1)}
    return [replace(b, merge_stop=firsts.get(b.index, "")) for b in build(merged, ops_of(by_op))]


def _grow(items: list[list], stop: Callable[[list, list[list[list]]], str | None]
          ) -> tuple[list[list[list]], list[str]]:
    """Greedy left-to-right runs: an item joins the current run unless ``stop`` gives a reason, given the run's elements
    with it and the whole grouping (the items after it alone). The runs, and why each after the first began."""
    done: list[list[list]] = []
    stops: list[str] = []
    current = [items[0]]
    for k in range(1, len(items)):
        trial = current + [items[k]]
        if (why := stop([x for item in trial for x in item], [*done, trial, *([i] for i in items[k + 1 :])])) is None:
            current = trial
        else:
            done.append(current)
            stops.append(why)
            current = [items[k]]
    done.append(current)
    return done, stops


def _free(live: np.ndarray, reference: np.ndarray, ceiling: float) -> bool:
    """Wherever ``live`` holds more than ``reference`` (the grouping before the merges), it stays under ``ceiling``."""
    raised = live > reference
    return not raised.any() or live[raised].max() <= ceiling


def _idle_everywhere(buckets: list[Bucket], model: MemoryModel) -> bool:
    """Every bucket still has compute between its shard op and its all-gather."""
    return all(model.compute_steps_between(b.shard_at, b.gather_at) > 0 for b in buckets)


def place_compactions(compactions: Sequence[Compaction], buckets: Sequence[Bucket], model: MemoryModel
                      ) -> list[Compaction]:
    """``compactions`` with the call making each taken one's copies: the first shard op at or after its step, else one
    call with the next lone compactions, wherever the predicted peak does not rise."""
    taken = {c.storage: c for c in compactions if c.compacted}
    if not taken:
        return list(compactions)
    # each compaction touches its own storage alone, so the changes add up
    sharded = model.live_bytes(buckets)
    changes: dict[tuple[str, int], np.ndarray] = {}

    def live(trial: dict[str, Compaction]) -> np.ndarray:
        for c in trial.values():
            if (c.storage, c.compact_at) not in changes:
                changes[c.storage, c.compact_at] = model.change(compactions=[c])
        return sharded + sum(changes[c.storage, c.compact_at] for c in trial.values())

    limit = live(taken).max()

    def peak_holds(trial: dict[str, Compaction]) -> bool:
        try:
            return live(trial).max() <= limit
        except ValueError:  # a copy would be made after its first use
            return False

    def moved(c: Compaction, step: int, op: int | None) -> Compaction:
        return replace(c, compact_at=step, shard_op=op, moved_from=c.compact_at if step != c.compact_at else None)

    anchors = sorted({(b.shard_at, b.shard_op) for b in buckets if not b.sources})  # a sources' bucket has no call
    for c in sorted(taken.values(), key=lambda c: c.compact_at):
        op = next(((step, k) for step, k in anchors if step >= c.compact_at), None)
        if op is not None and peak_holds(trial := {**taken, c.storage: moved(c, *op)}):
            taken = trial
    run: list[Compaction] = []  # compactions made alone, batched into the call of the run's last one
    for c in sorted((c for c in taken.values() if c.shard_op is None), key=lambda c: c.compact_at):
        trial = {**taken, **{r.storage: moved(r, c.compact_at, None) for r in run}}
        if run and peak_holds(trial):
            taken = trial
            run.append(c)
        else:
            run = [c]
    return [taken.get(c.storage, c) if c.compacted else c for c in compactions]
