"""Integrations: how a distributed setup tells the pass its process group and which values are identical on every rank.

Each integration is one small module with ``detect(compile_data) -> Integration | None``. The pass asks them in
:data:`INTEGRATIONS` order while compiling and uses the first that recognizes the compilation; the replication
analysis then starts from the integration's *replicated roots*: the all-gathers over its group (always), plus the
trace inputs it names (:meth:`Integration.replicated_inputs`). A new setup is one more module here.

The process group is the setup's own (FSDP's, DDP's, FSDP2's shard group). Where a setup names none, the pass takes
the ``group=`` option; where it names one, ``group=`` (if given) must span the same ranks. A setup whose replicated
values are identical on more ranks than its group's (FSDP2 HSDP: the whole mesh, its group the mesh's shard dimension)
names them in :attr:`Integration.replica_ranks`; ``shard_group_size`` partitions those (see
:mod:`thunder_fp8shard.shard_groups`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch.distributed as dist
from thunder.core.trace import TraceCtx

from thunder_fp8shard.integrations import fsdp2_thunderfx, thunder_ddp, thunder_fsdp


@dataclass(frozen=True)
class Integration:
    """A recognized distributed setup."""

    name: str  # shown in the plan, e.g. "Thunder FSDP (ZeRO-3)"
    # the setup's process group: its all-gathers are replicated roots, the replicated values are identical over its
    # ranks (and over ``replica_ranks`` where given), and the shards travel on it by default
    group: object
    replicated_inputs: Callable[[TraceCtx], frozenset[str]] = lambda trace: frozenset()
    # why the other trace inputs are per-rank, where the setup knows better than "the rank's input"
    input_reasons: Callable[[TraceCtx], Mapping[str, str]] = lambda trace: {}
    notes: tuple[str, ...] = field(default=())  # what the plan should say about this setup
    # the global ranks the replicated values are identical on, in order, where more than ``group``'s (FSDP2 HSDP: the
    # whole mesh); None: ``group``'s
    replica_ranks: tuple[int, ...] | None = None

    @property
    def ranks(self) -> tuple[int, ...]:
        """The global ranks the replicated values are identical on: what ``shard_group_size`` partitions."""
        return self.replica_ranks or tuple(dist.get_process_group_ranks(self.group))

    @property
    def world_size(self) -> int:
        return len(self.ranks)


def group_of(compile_data, flag: str):
    """The process group Thunder's ``fsdp``/``ddp`` recorded in the compile data when ``compile_data.<flag>`` is
    set (``use_fsdp``, ``use_ddp``), else None."""
    if compile_data is None or not getattr(compile_data, flag, False):
        return None
    return getattr(compile_data, "process_group_for_ddp", None)


INTEGRATIONS = (thunder_fsdp.detect, thunder_ddp.detect, fsdp2_thunderfx.detect)

USAGE = (
    "ShardIntermediates needs Thunder FSDP or DDP, or FSDP2 under ThunderFX: use thunder.jit(model, "
    "transforms=[FSDPTransform(...), ShardIntermediates()]), thunder.distributed.fsdp(thunder.jit(model, "
    "transforms=[ShardIntermediates()])), thunder.distributed.ddp(thunder.jit(model, "
    f"transforms=[ShardIntermediates()])); {fsdp2_thunderfx.USAGE}"
)


def detect(compile_data, options) -> Integration:
    """The integration of this compilation; raises a clear error when there is none, or no process group."""
    for find in INTEGRATIONS:
        found = find(compile_data, options)
        if found is not None:
            if not dist.is_initialized():
                raise RuntimeError("ShardIntermediates needs an initialized torch.distributed process group")
            given = options.group
            if given is not None and given is not found.group and (
                    dist.get_process_group_ranks(given) != dist.get_process_group_ranks(found.group)):
                raise ValueError(
                    f"ShardIntermediates: group= spans ranks {dist.get_process_group_ranks(given)}, but {found.name} "
                    f"works over ranks {dist.get_process_group_ranks(found.group)}; leave group= out (the setup names "
                    "its group) or pass one over the same ranks"
                )
            return found
    raise RuntimeError(USAGE)
