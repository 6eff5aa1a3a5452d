"""Thunder's DDP: the parameters are identical on every rank (broadcast at wrapping, then updated with all-reduced
gradients), so the roots are the inputs DDP marks ``REPLICATED``. With ``broadcast_from=None`` identical starting
weights are the caller's promise, which ``verify=True`` checks."""

from __future__ import annotations

from thunder.core.proxies import DistParallelType, TensorProxy

from thunder_fp8shard.analysis.saved import forward_inputs
from thunder_fp8shard.distributed.integrations.base import Integration, group_of


def replicated_parameters(trace) -> frozenset[str]:
    return frozenset(
        p.name for p in forward_inputs(trace)
        if isinstance(p, TensorProxy) and getattr(p, "distparallel_type", None) == DistParallelType.REPLICATED
    )


def detect(cd, options):
    group = group_of(cd, "use_ddp")
    if group is None:
        return None
    return Integration("Thunder DDP", group, replicated_inputs=replicated_parameters)
