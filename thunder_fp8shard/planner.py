"""The planner: decides, for every candidate, whether to shard it, and says why. Pure functions over plain data.

``soundness`` decides what *may* be sharded (replicated, worth a collective, freeing its storage);
``schedule`` places each sharded tensor's shard point, all-gather and first use on the joint timeline;
``choose`` applies the policy (all sound candidates, only those lowering the predicted peak, or the least
all-gather traffic meeting a byte budget) by evaluating the memory model of :mod:`thunder_fp8shard.liveness`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from thunder.core.trace import TraceCtx

from thunder_fp8shard.candidates import Candidate
from thunder_fp8shard.liveness import (
    Life, ShardedLife, Step, Timeline, is_compute, joint_graph, program_steps, storage_lives, timeline, uses,
    with_sharding,
)
from thunder_fp8shard.ops import shard_numel
from thunder_fp8shard.options import ShardOptions
from thunder_fp8shard.plan import Decision
from thunder_fp8shard.replication import Replication


@dataclass(frozen=True)
class Placement:
    """Where a candidate sits on the joint timeline (step indices of the unmodified program)."""

    life: str  # name of its storage's Life
    shard_at: int  # its last forward use: the shard replaces it right after
    first_use: int  # its first backward consumer: the wait goes right before


@dataclass(frozen=True)
class MemoryModel:
    """The unmodified joint program's storages, steps and the placement of every candidate."""

    lives: dict[str, Life]
    steps: tuple[Step, ...]
    placements: dict[str, Placement]  # by candidate name; missing when a candidate is never used in backward
    compute: tuple[bool, ...]  # per step: False for bookkeeping (del, clears, unpacks, return)

    def compute_steps_between(self, first: int, last: int) -> int:
        """Compute steps strictly between two steps."""
        return sum(self.compute[first + 1 : last])

    def evaluate(self, chosen: list[Decision], prefetch: int) -> tuple[Timeline, tuple[int, ...]]:
        """The predicted timeline when ``chosen`` are sharded, and the steps where their gathers are issued."""
        sharded = schedule(chosen, self.placements, prefetch, self.backward_body_start)
        return timeline(with_sharding(self.lives, self.steps, sharded), self.steps), tuple(
            sorted(s.gather_at for s in sharded.values())
        )

    @property
    def backward_body_start(self) -> int:
        """First compute step of the backward: the rewrite issues the earliest gathers right before it."""
        first_backward = next((s.index for s in self.steps if s.phase == "backward"), len(self.steps) - 1)
        return next((i for i in range(first_backward, len(self.steps)) if self.compute[i]), len(self.steps) - 1)


def soundness(
    candidates: list[Candidate], replication: Replication, model_io: set[str], options: ShardOptions, world_size: int,
    model: MemoryModel, saved_names: set[str],
) -> list[Decision]:
    """Marks each candidate sharded if sharding it is sound and frees memory; otherwise gives the reason."""
    decisions = []
    for c in candidates:
        replicated = replication.is_replicated(c.name)
        why = None
        if c.name in model_io:
            why = "a model input or output: the caller keeps it alive, sharding frees nothing"
        elif not replicated:
            why = f"per-rank: {replication.reason(c.name)}"
        elif world_size < 2:
            why = "world size is 1: there is nothing to shard over"
        elif c.payload_bytes < options.min_bytes:
            why = f"smaller than min_bytes={options.min_bytes}"
        elif c.name not in model.placements:
            why = "not used in backward"
        elif others := _storage_sharers(c, model, saved_names):
            why = f"shares its storage with saved tensor(s) {', '.join(others)}: sharding it alone frees nothing"
        decisions.append(_decision(c, replicated, world_size, why))
    return decisions


def schedule(chosen: list[Decision], placements: dict[str, Placement], prefetch: int, body_start: int):
    """``ShardedLife`` per storage: gathers in order of first use, each issued at the first use of the gather
    ``prefetch`` places earlier (or at the start of the backward), as :func:`thunder_fp8shard.rewrite.rewrite_backward`
    places them."""
    order = sorted(chosen, key=lambda d: placements[d.name].first_use)
    sharded = {}
    for j, d in enumerate(order):
        p = placements[d.name]
        gather_at = placements[order[j - prefetch].name].first_use if j >= prefetch else body_start
        sharded[p.life] = ShardedLife(p.life, d.shard_nbytes, p.shard_at, gather_at, p.first_use)
    return sharded


def choose(sound: list[Decision], model: MemoryModel, options: ShardOptions) -> tuple[list[Decision], list[str]]:
    """Applies the policy to the sound decisions; returns the final decisions and notes for the plan."""
    candidates = [d for d in sound if d.sharded]
    refused: dict[str, str] = {}
    notes: list[str] = []
    planned = schedule(candidates, model.placements, options.prefetch, model.backward_body_start)
    for d in candidates:
        s = planned[model.placements[d.name].life]
        if model.compute_steps_between(s.shard_at, s.gather_at) == 0:
            refused[d.name] = "idle interval too short: its all-gather would be issued right after it is sharded"
    candidates = [d for d in candidates if d.name not in refused]
    if options.policy != "all":
        target = options.budget_bytes if options.policy == "budget" else None
        notes = _greedy(candidates, model, planned, target, refused)
    final = [d if d.name not in refused else replace(d, sharded=False, shard_nbytes=0, reason=refused[d.name]) for d in sound]
    return final, notes


def _greedy(candidates, model: MemoryModel, planned, target, refused) -> list[str]:
    """Adds, one at a time, the candidate that lowers the predicted peak most per byte it will all-gather, until the
    peak stops falling (policy "peak") or reaches ``target`` (policy "budget"). Each candidate's effect is taken
    with the gather placement of ``planned``; fills ``refused`` and returns notes for the plan."""
    steps = model.steps
    base = np.array(timeline(model.lives, steps).live_bytes, dtype=np.int64)
    deltas = {}
    for d in candidates:
        name = model.placements[d.name].life
        alone = {name: model.lives[name]}
        sharded = with_sharding(alone, steps, {name: planned[name]})
        deltas[d.name] = _live_bytes(sharded.values(), len(steps)) - _live_bytes(alone.values(), len(steps))
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


def _live_bytes(lives, n_steps: int) -> np.ndarray:
    """Bytes live per step of a few lives (the vectorised counterpart of ``liveness.timeline``)."""
    delta = np.zeros(n_steps + 1, dtype=np.int64)
    for life in lives:
        delta[life.start] += life.nbytes
        delta[life.end + 1] -= life.nbytes
    return np.cumsum(delta[:-1])


def _storage_sharers(c: Candidate, model: MemoryModel, saved_names: set[str]) -> list[str]:
    life = model.lives[model.placements[c.name].life]
    return sorted(m for m in life.members if m != c.name and m in saved_names)


def _decision(c: Candidate, replicated: bool, world_size: int, refused: str | None) -> Decision:
    return Decision(
        name=c.name, shape=tuple(int(s) for s in c.proxy.shape), dtype=str(c.proxy.dtype).removeprefix("thunder.dtypes."),
        kind=c.kind, nbytes=c.payload_bytes, replicated=replicated, sharded=refused is None,
        reason=refused or f"identical on every rank; rank keeps 1/{world_size}",
        shard_nbytes=shard_numel(c.payload_bytes, world_size) if refused is None else 0,
    )


def memory_model(fw: TraceCtx, bw: TraceCtx, candidates: list[Candidate], nbytes_of) -> MemoryModel:
    """Builds the joint program's storages and steps, and places every candidate on them."""
    graph = joint_graph(fw, bw)
    lives = storage_lives(fw, bw, nbytes_of=nbytes_of, graph=graph)
    steps = program_steps(fw, bw)
    life_of = {m: life.name for life in lives.values() for m in life.members}
    backward_start = graph.graph["backward_start"]
    compute = tuple(is_compute(graph.nodes[i]["bsym"]) for i in range(len(steps)))
    placements = {}
    for c in candidates:
        life = lives[life_of[c.name]]
        forward_uses = [u for u in uses(graph, life.members) if u < backward_start]
        backward_uses = [u for u in uses(graph, [c.name]) if u >= backward_start and compute[u]]
        if backward_uses:
            placements[c.name] = Placement(life.name, max([life.start, *forward_uses]), min(backward_uses))
    return MemoryModel(lives, steps, placements, compute)

