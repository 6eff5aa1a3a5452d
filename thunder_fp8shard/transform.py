"""``ShardIntermediates``: the Thunder transform tying analysis, plan and rewrite together."""

from __future__ import annotations

import dataclasses
import logging

import torch.distributed as dist
from thunder.core.compile_data import get_compile_data
from thunder.core.trace import TraceCtx, TraceTag
from thunder.core.transform_common import Transform

from thunder_fp8shard.candidates import find_candidates
from thunder_fp8shard.options import ShardOptions
from thunder_fp8shard.plan import ShardPlan
from thunder_fp8shard.planner import soundness
from thunder_fp8shard.replication import analyze_replication
from thunder_fp8shard.rewrite import ForwardRewrite, ShardRequest, rewrite_backward, rewrite_forward
from thunder_fp8shard.saved import forward_saved, model_io_names, tensor_nbytes

log = logging.getLogger(__name__)


class ShardIntermediates(Transform):
    """Shards saved-for-backward tensors that are identical on every rank (FSDP ZeRO-3) and all-gathers them back
    just before their backward consumers. Gradients are bitwise identical to the run without the pass.

    Use after Thunder's FSDP: ``thunder.jit(model, transforms=[FSDPTransform(sharding_strategy=FSDPType.ZERO3),
    ShardIntermediates()])``. Options: see :class:`thunder_fp8shard.options.ShardOptions`. ``plans`` holds one
    :class:`~thunder_fp8shard.plan.ShardPlan` per compiled cache entry, newest last.
    """

    def __init__(self, **options):
        known = {f.name for f in dataclasses.fields(ShardOptions)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"ShardIntermediates: unknown option(s) {unknown}; known options are {sorted(known)}")
        self.options = ShardOptions(**options)
        self.plans: list[ShardPlan] = []
        self._handoff: ForwardRewrite | None = None  # forward -> backward of the cache entry being compiled

    def transform_trace_post_optimization(self, computation_trace: TraceCtx, **kwargs) -> TraceCtx:
        if TraceTag.AUGMENTED_FORWARD in computation_trace.tags:
            return self._forward(computation_trace)
        if TraceTag.BACKWARD in computation_trace.tags:
            return self._backward(computation_trace)
        return computation_trace

    def _forward(self, fw: TraceCtx) -> TraceCtx:
        self._handoff = None
        group, world_size = _fsdp_group()
        o = self.options
        candidates = find_candidates(fw, o.candidates)
        decisions = soundness(candidates, analyze_replication(fw, group), model_io_names(fw), o, world_size)
        saved_tensors, _ = forward_saved(fw)
        sizes = {c.name: c.payload_bytes for c in candidates}
        before = sum(sizes.get(p.name, tensor_nbytes(p)) for p in {p.name: p for p in saved_tensors}.values())
        plan = ShardPlan(
            world_size=world_size, method=o.method, policy=o.policy, prefetch=o.prefetch, decisions=decisions,
            saved_bytes_before=before, saved_bytes_after=before - sum(d.bytes_saved for d in decisions),
        )
        if not saved_tensors:
            plan.notes.append("forward-only compile (no_grad or no input requires grad): nothing is saved for backward")
        self.plans.append(plan)
        log.info("%s", plan)
        chosen = [c for c, d in zip(candidates, decisions) if d.sharded]
        if not chosen:
            return fw
        requests = [ShardRequest(c.proxy, c.payload_bytes) for c in chosen]
        self._handoff = rewrite_forward(
            fw, requests, group=group, world_size=world_size, method=o.method, verify=o.verify,
            provenance=f"ShardIntermediates: saved {len(chosen)} tensors as 1/{world_size} shards ({o.method})",
        )
        return self._handoff.trace

    def _backward(self, bw: TraceCtx) -> TraceCtx:
        handoff, self._handoff = self._handoff, None
        if handoff is None:
            return bw
        group, _ = _fsdp_group()
        new, _ = rewrite_backward(
            bw, handoff, group=group, prefetch=self.options.prefetch,
            provenance=f"ShardIntermediates: all-gather {len(handoff.sharded)} sharded tensors "
            f"(prefetch {self.options.prefetch})",
        )
        return new


def _fsdp_group():
    """The FSDP process group of the compilation and its size; raises a clear error when there is none to use."""
    cd = get_compile_data()
    group = getattr(cd, "process_group_for_ddp", None) if cd is not None else None
    if cd is None or not getattr(cd, "use_fsdp", False) or group is None:
        raise RuntimeError(
            "ShardIntermediates needs Thunder FSDP: use thunder.jit(model, transforms=[FSDPTransform(...), "
            "ShardIntermediates()]) or thunder.distributed.fsdp(thunder.jit(model, transforms=[ShardIntermediates()]))"
        )
    from thunder.distributed import FSDPType

    strategy = getattr(cd.fn, "sharding_strategy", None)
    if strategy is not None and strategy != FSDPType.ZERO3:
        raise RuntimeError(
            f"ShardIntermediates re-gathers saved tensors in backward, which is ZeRO-3 behaviour, but FSDP runs with "
            f"{strategy}; use sharding_strategy=FSDPType.ZERO3"
        )
    if not dist.is_initialized():
        raise RuntimeError("ShardIntermediates needs an initialized torch.distributed process group")
    return group, dist.get_world_size(group)
