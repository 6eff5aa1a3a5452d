"""Thunder's FSDP: the replicated roots are the all-gathers of the parameter shards over FSDP's group. ZeRO-2 and ZeRO-3
give identical traces; under ZeRO-2 the full-precision gathered weights stay gathered unless ``candidates="all"``."""

from __future__ import annotations

from thunder_fp8shard.distributed.integrations.base import Integration, group_of


def detect(cd, options):
    from thunder.distributed import FSDPType

    group = group_of(cd, "use_fsdp")
    if group is None:
        return None
    strategy = getattr(cd.fn, "sharding_strategy", None)
    if strategy == FSDPType.ZERO2:
        note = ("Thunder FSDP ZeRO-2: the sharded FP8 copies are re-gathered in backward; "
                + ("candidates='all' re-gathers the full-precision gathered weights too, which ZeRO-2 would keep"
                   if options.candidates == "all" else "the full-precision gathered weights stay gathered"))
        return Integration("Thunder FSDP (ZeRO-2)", group, notes=(note,), keeps_gathered=True)
    return Integration("Thunder FSDP (ZeRO-3)", group)
