"""Run-time operators the rewrite inserts: small Thunder operators (meta + Python implementation).

Forward:  ``shard, restorer = fp8shard_shard(t, group, world_size, method, verify, name)``
Backward: ``handle = fp8shard_gather_start(shard, group)`` (issues the all-gather) and later
          ``t = fp8shard_gather_wait(handle, restorer)`` (waits, rebuilds the original object).

Shards are flat ``uint8`` tensors of ``ceil(payload_bytes / world_size)`` bytes: the last ranks' shards are zero
padded, and the gather slices the padding off, so no byte is ever dropped. Bytes travel as ``uint8`` because gloo
refuses float8 collectives. The executor below is never passed to ``thunder.jit``: operators inserted after
``transform_for_execution`` run through their bound symbols' call context.
"""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from thunder.core import dtypes
from thunder.core.proxies import AnyProxy, TensorProxy
from thunder.extend import OperatorExecutor

from thunder_fp8shard import payload

executor = OperatorExecutor("fp8shard")


def shard_numel(payload_bytes: int, world_size: int) -> int:
    """Bytes of one rank's shard of a ``payload_bytes`` payload (the payload padded to a multiple of the world size)."""
    return -(-payload_bytes // world_size)


# ---- forward: keep 1/N of a replicated payload -------------------------------------------------------------------


def _shard_meta(t, group, world_size: int, payload_bytes: int, method: str, verify: bool, name: str):
    shard = TensorProxy(like=t, shape=(shard_numel(payload_bytes, world_size),), dtype=dtypes.uint8, requires_grad=False)
    return shard, AnyProxy(payload.Restorer("", 0, None), prefix="restore")  # the object only names the type


def _shard_impl(t, group, world_size: int, payload_bytes: int, method: str, verify: bool, name: str):
    flat, restorer = payload.to_bytes(t)
    if verify:
        check_identical_across_ranks(flat, group, name)
    size = shard_numel(flat.numel(), world_size)
    if method == "reduce_scatter":
        padded = torch.nn.functional.pad(flat, (0, size * world_size - flat.numel()))
        shard = torch.empty(size, dtype=torch.uint8, device=flat.device)
        # identical replicas: MAX of equal bytes is those bytes
        dist.reduce_scatter_tensor(shard, padded, op=dist.ReduceOp.MAX, group=group)
        return shard, restorer
    rank = dist.get_rank(group)
    piece = flat[rank * size : (rank + 1) * size]
    shard = torch.zeros(size, dtype=torch.uint8, device=flat.device)  # a fresh allocation: the full copy can be freed
    shard[: piece.numel()].copy_(piece)
    return shard, restorer


shard = executor.register_operator("fp8shard_shard", meta=_shard_meta, fn=_shard_impl)


def check_identical_across_ranks(flat: torch.Tensor, group, name: str) -> None:
    """Raises on every rank if the ranks' payloads differ (all-gathers a SHA-256 digest of each rank's bytes)."""
    digest = hashlib.sha256(flat.detach().cpu().numpy().tobytes()).digest()
    mine = torch.tensor(list(digest), dtype=torch.uint8, device=flat.device)
    everyone = torch.empty(dist.get_world_size(group) * mine.numel(), dtype=torch.uint8, device=flat.device)
    dist.all_gather_into_tensor(everyone, mine, group=group)
    digests = everyone.view(-1, mine.numel())
    differing = [r for r in range(digests.shape[0]) if not torch.equal(digests[r], digests[0])]
    if differing:
        raise RuntimeError(
            f"ShardIntermediates(verify=True): saved tensor {name!r} is not identical on every rank "
            f"(ranks {differing} differ from rank 0), so it cannot be rebuilt from shards. The replication analysis "
            "accepted a per-rank tensor: please report this with the forward trace."
        )


# ---- backward: all-gather the shards and rebuild ------------------------------------------------------------------


def _gather_start_meta(shard, group):
    return AnyProxy(GatherHandle(None, None), prefix="gather")  # the object only names the type


class GatherHandle(NamedTuple):
    """An all-gather in flight: its work handle and the buffer it fills."""

    work: Any
    buffer: torch.Tensor


def _gather_start_impl(shard: torch.Tensor, group) -> GatherHandle:
    out = torch.empty(shard.numel() * dist.get_world_size(group), dtype=torch.uint8, device=shard.device)
    return GatherHandle(dist.all_gather_into_tensor(out, shard, group=group, async_op=True), out)


gather_start = executor.register_operator("fp8shard_gather_start", meta=_gather_start_meta, fn=_gather_start_impl)


def _gather_wait_meta(handle, restorer):
    raise NotImplementedError("fp8shard_gather_wait is bound by the rewrite with the restored proxy as its output")


def _gather_wait_impl(handle: GatherHandle, restorer: payload.Restorer):
    handle.work.wait()
    return payload.from_bytes(handle.buffer, restorer)


gather_wait = executor.register_operator("fp8shard_gather_wait", meta=_gather_wait_meta, fn=_gather_wait_impl)
