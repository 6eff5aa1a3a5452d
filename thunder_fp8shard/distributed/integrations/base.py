""":class:`Integration`, what every integration returns, and :func:`group_of`, the group Thunder's ``fsdp``/``ddp``
record."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch.distributed as dist
from thunder.core.trace import TraceCtx


@dataclass(frozen=True)
class Integration:
    """A recognized distributed setup."""

    name: str  # shown in the plan
    # replicated values are identical over its ranks (or ``replica_ranks``); the default shard group
    group: object
    replicated_inputs: Callable[[TraceCtx], frozenset[str]] = lambda trace: frozenset()
    # why the other inputs are per-rank, where the setup knows better than "the rank's input"
    input_reasons: Callable[[TraceCtx], Mapping[str, str]] = lambda trace: {}
    notes: tuple[str, ...] = field(default=())  # what the plan should say about this setup
    # where more than ``group``'s ranks hold the replicated values (FSDP2 HSDP: the whole mesh)
    replica_ranks: tuple[int, ...] | None = None
    # ZeRO-2 keeps the gathered weights on purpose
    keeps_gathered: bool = False

    @property
    def ranks(self) -> tuple[int, ...]:
        """The global ranks replicated values are identical on: what ``shard_group_size`` partitions."""
        return self.replica_ranks or tuple(dist.get_process_group_ranks(self.group))

    @property
    def world_size(self) -> int:
        return len(self.ranks)


def group_of(compile_data, flag: str):
    """The process group Thunder's ``fsdp``/``ddp`` recorded when ``compile_data.<flag>`` is set, else None."""
    if compile_data is None or not getattr(compile_data, flag, False):
        return None
    return getattr(compile_data, "process_group_for_ddp", None)
