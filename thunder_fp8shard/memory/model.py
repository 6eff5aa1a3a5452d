"""The memory model: the program's storages and steps, each candidate's place on them, the compaction options and the
step's other memory; the one evaluator of choices."""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from thunder_fp8shard.analysis.candidates import Candidate
from thunder_fp8shard.analysis.compaction import program_compactions
from thunder_fp8shard.analysis.liveness import (
    CompactedStorage, Life, ShardedStorages, Step, Timeline, backward_start, is_compute, life_spans, span_bytes,
    storage_of, uses, with_compaction, with_sharding,
)
from thunder_fp8shard.analysis.program import ProgramFacts
from thunder_fp8shard.options import ShardOptions
from thunder_fp8shard.plan import Bucket, Compaction, MemoryTerm
from thunder_fp8shard.memory.resident import step_terms, term_lives


@dataclass(frozen=True)
class Placement:
    """Where a candidate sits on the joint timeline (step indices of the unmodified program)."""

    life: str  # its storage's Life
    shard_at: int  # its last forward use: the shard replaces it right after
    first_use: int  # its first backward consumer: the wait goes right before


@dataclass(frozen=True)
class MemoryModel:
    """The unmodified program's storages, steps and candidate placements, and the step's other memory."""

    lives: dict[str, Life]
    steps: tuple[Step, ...]
    placements: dict[str, Placement]  # missing for a candidate never used in backward
    compute: tuple[bool, ...]  # per step: False for bookkeeping
    terms: tuple[MemoryTerm, ...] = ()
    compactions: tuple[Compaction, ...] = ()  # none taken
    # the all-gather holds a temporary of its whole output from issue to wait (gloo on the CPU)
    gather_scratch: bool = False
    # ``(key, first, last, bytes)``: the spans a forward rewrite's resize items change (the FP8 forward gather's, by
    # weight), whatever is sharded; left out of the run without the pass
    rewritten: tuple[tuple[str, int, int, int], ...] = ()
    resize_moved: Mapping[str, int] = field(default_factory=dict)  # what each resize item changes in the bytes moved

    def compute_steps_between(self, first: int, last: int) -> int:
        """Compute steps strictly between two steps."""
        if last <= first + 1:
            return 0
        return int(self._compute_before[last] - self._compute_before[first + 1])

    @functools.cached_property
    def life_of(self) -> dict[str, Life]:
        """Tensor name -> its storage's life."""
        return storage_of(self.lives)

    @functools.cached_property
    def _compute_before(self) -> np.ndarray:
        """Compute steps before each step: a prefix sum, as the planner asks for many intervals."""
        return np.concatenate(([0], np.cumsum(np.asarray(self.compute, dtype=np.int64))))

    def evaluate(self, buckets: Sequence[Bucket] = (), compactions: Sequence[Compaction] = (), *,
                 terms: bool = True, rewritten: bool | Collection[str] = True) -> Timeline:
        """The predicted device timeline with ``buckets`` sharded and ``compactions`` made and the resize items
        ``rewritten`` names (True: all; False: none, as without the pass)."""
        live = self.live_bytes(buckets, compactions, terms=terms, rewritten=rewritten)
        return Timeline(self.steps, tuple(live.tolist()), backward_start(self.steps))

    def live_bytes(self, buckets: Sequence[Bucket] = (), compactions: Sequence[Compaction] = (), *,
                   terms: bool = True, rewritten: bool | Collection[str] = True) -> np.ndarray:
        """Bytes live at each step with ``buckets`` sharded, ``compactions`` made and the resize items ``rewritten``
        names."""
        live = self._program_bytes + self.change(buckets, compactions)
        if rewritten:
            live = live + (self._rewritten_bytes if rewritten is True else self.resized(rewritten))
        return live + self._term_bytes if terms else live

    def resized(self, keys: Collection[str]) -> np.ndarray:
        """What the resize items ``keys`` change in the live bytes at each step."""
        return span_bytes([span for key, *span in self.rewritten if key in keys], len(self.steps))

    def change(self, buckets: Sequence[Bucket] = (), compactions: Sequence[Compaction] = ()) -> np.ndarray:
        """What ``buckets`` and ``compactions`` change in the live bytes at each step, on the storages they touch
        alone."""
        if not buckets and not compactions:
            return np.zeros(len(self.steps), dtype=np.int64)
        groups = [self.sharded_storages(b) for b in buckets]
        touched = {name: self.lives[name] for g in groups for name in g.lives}
        touched.update((c.storage, self.lives[c.storage]) for c in compactions)
        after = with_compaction(with_sharding(touched, self.steps, groups), [
            CompactedStorage(c.storage, c.members, c.member_nbytes, c.compact_at, c.ends) for c in compactions])
        n = len(self.steps)
        return span_bytes(life_spans(after.values()), n) - span_bytes(life_spans(touched.values()), n)

    @functools.cached_property
    def _program_bytes(self) -> np.ndarray:
        return span_bytes(life_spans(self.lives.values()), len(self.steps))

    @functools.cached_property
    def _rewritten_bytes(self) -> np.ndarray:
        return span_bytes([span for _, *span in self.rewritten], len(self.steps))

    @functools.cached_property
    def _term_bytes(self) -> np.ndarray:
        return span_bytes(life_spans(term_lives(list(self.terms)).values()), len(self.steps))

    def sharded_storages(self, b: Bucket) -> ShardedStorages:
        """What sharding bucket ``b`` does to its storages."""
        lives = tuple(dict.fromkeys(self.placements[n].life for n in b.members))
        kept = 0 if b.sources else b.shard_nbytes  # forward inputs, held by the caller anyway
        return ShardedStorages(f"bucket{b.index}", lives, kept, b.gathered_nbytes, b.shard_at, b.gather_at,
                               b.first_use, b.shard_until, b.gathered_nbytes if self.gather_scratch else 0)

    @property
    def backward_body_start(self) -> int:
        """First compute step of the backward: the earliest gathers are issued right before it."""
        return next((i for i in range(backward_start(self.steps), len(self.steps)) if self.compute[i]),
                    len(self.steps) - 1)


def memory_model(
    facts: ProgramFacts, candidates: list[Candidate], *, options: ShardOptions | None = None, device=None,
    gather_scratch: bool = False, resized: Mapping[str, tuple[int, Mapping[str, int]]] | None = None,
    compactions: Sequence[Compaction] | None = None,
) -> MemoryModel:
    """Places every candidate on the program's storages and adds the step's other memory (without ``options``, the
    program's alone). ``resized``: the forward rewrite's resize items, by key: what each changes in the bytes moved and
    the new bytes of the proxies it resizes; ``compactions``: the options (None: found here)."""
    graph, lives, steps, bw_start = facts.graph, facts.lives, facts.steps, facts.backward_start
    life_of = facts.life_of
    compute = tuple(is_compute(graph.nodes[i]["bsym"]) for i in range(len(steps)))
    placements = {}
    for c in candidates:
        life = life_of[c.name]
        forward_uses = [u for u in uses(graph, life.members) if u < bw_start]
        backward_uses = [u for u in uses(graph, [c.name]) if u >= bw_start and compute[u]]
        if backward_uses:
            placements[c.name] = Placement(life.name, max([life.start, *forward_uses]), min(backward_uses))
    terms = tuple(step_terms(facts, options, device)) if options is not None else ()
    compactions = program_compactions(facts, candidates) if compactions is None else tuple(compactions)
    resized = resized or {}  # each storage one of whose proxies an item resizes: the item's key, its new size
    new = {m: (key, size) for key, (_, sizes) in resized.items() for m, size in sizes.items()}
    hits = ((life, next((new[m] for m in life.members if m in new), None)) for life in lives.values())
    rewritten = tuple((hit[0], life.start, life.end, hit[1] - life.nbytes) for life, hit in hits if hit is not None)
    return MemoryModel(lives, steps, placements, compute, terms, compactions, gather_scratch, rewritten,
                       {key: moved for key, (moved, _) in resized.items()})


def gathers_hold_scratch(group, device: str | None) -> bool:
    """Whether an all-gather over ``group`` holds a temporary of its whole output in the program's memory: gloo's on CPU
    tensors does, NCCL and the fake group do not."""
    import torch.distributed as dist

    try:
        return group is not None and device is None and dist.get_backend(group) == "gloo"
    except (RuntimeError, ValueError):  # not a process group torch knows
        return False
