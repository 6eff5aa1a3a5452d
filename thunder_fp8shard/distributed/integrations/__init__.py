"""How a distributed setup tells the pass its process group and which values are identical on every rank. Each module's
``detect`` returns an :class:`Integration` or None; the first match wins. The replication analysis starts from the
all-gathers over its group plus the inputs it names."""

from __future__ import annotations

import torch.distributed as dist

from thunder_fp8shard.distributed.integrations import fsdp2_thunderfx, thunder_ddp, thunder_fsdp
from thunder_fp8shard.distributed.integrations.base import Integration, group_of

__all__ = ["INTEGRATIONS", "USAGE", "Integration", "detect", "group_of"]


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
