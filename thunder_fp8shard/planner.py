"""The planner: decides, for every candidate, whether to shard it, and says why. Pure functions over plain data."""

from __future__ import annotations

from thunder.core.trace import TraceCtx

from thunder_fp8shard.candidates import Candidate
from thunder_fp8shard.ops import shard_numel
from thunder_fp8shard.options import ShardOptions
from thunder_fp8shard.plan import Decision
from thunder_fp8shard.replication import Replication


def soundness(
    candidates: list[Candidate], replication: Replication, model_io: set[str], options: ShardOptions, world_size: int
) -> list[Decision]:
    """Marks each candidate sharded if sharding it is sound and worth a collective; otherwise gives the reason."""
    decisions = []
    for c in candidates:
        replicated = replication.is_replicated(c.name)
        if c.name in model_io:
            why = "a model input or output: the caller keeps it alive, sharding frees nothing"
        elif not replicated:
            why = f"per-rank: {replication.reason(c.name)}"
        elif world_size < 2:
            why = "world size is 1: there is nothing to shard over"
        elif c.payload_bytes < options.min_bytes:
            why = f"smaller than min_bytes={options.min_bytes}"
        else:
            why = None
        decisions.append(_decision(c, replicated, world_size, why))
    return decisions


def _decision(c: Candidate, replicated: bool, world_size: int, refused: str | None) -> Decision:
    return Decision(
        name=c.name, shape=tuple(int(s) for s in c.proxy.shape), dtype=str(c.proxy.dtype).removeprefix("thunder.dtypes."),
        kind=c.kind, nbytes=c.payload_bytes, replicated=replicated, sharded=refused is None,
        reason=refused or f"identical on every rank; rank keeps 1/{world_size}",
        shard_nbytes=shard_numel(c.payload_bytes, world_size) if refused is None else 0,
    )
