"""Thunder's FSDP (``FSDPTransform`` / ``thunder.distributed.fsdp``): the replicated roots are the all-gathers of the
parameter shards over FSDP's process group (the replication analysis recognizes them by their group).

In Thunder 0.2.6 ZeRO-2 and ZeRO-3 give identical traces: the gathered weights are saved for backward in both. Under
ZeRO-2 the pass still re-gathers the FP8 copies it shards; the full-precision gathered weights stay gathered, as
ZeRO-2 asks, unless ``candidates="all"`` shards them too.
"""

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
