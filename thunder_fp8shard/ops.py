"""Run-time operators the rewrite inserts: small Thunder operators (meta + Python implementation), one call per bucket.

Forward:  ``shard, restorer = fp8shard_shard((t1, ..., tk), group, world_size, shard_nbytes, method, verify, names)``
Backward: ``handle = fp8shard_gather_start(shard, group)`` (issues the all-gather) and later
          ``t1, ..., tk = fp8shard_gather_wait(handle, restorer)`` (waits; each member is a view of the gathered
          buffer, see :mod:`thunder_fp8shard.layout`).

Shards are flat ``uint8`` tensors (bytes travel as ``uint8`` because gloo refuses float8 collectives); the gathered
buffer is the bucket's layout padded to a multiple of the world size, so no byte is ever dropped. While a profiler
runs, each operator runs under a ``record_function`` range named after it. The executor below is never passed to
``thunder.jit``: operators inserted after ``transform_for_execution`` run through their bound symbols' call context.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from thunder.core import dtypes
from thunder.core.proxies import AnyProxy, TensorProxy
from thunder.extend import OperatorExecutor

from thunder_fp8shard import payload
from thunder_fp8shard.layout import BucketLayout, bucket_layout

executor = OperatorExecutor("fp8shard")


def _annotate(name: str):
    """A profiler range named ``name`` while ``torch.profiler`` records, else nothing: the operators run hundreds of
    times a step on a CPU-bound training loop, and an idle ``record_function`` costs as much as a small kernel launch."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


@dataclass
class Restorer:
    """What, besides the gathered bytes, rebuilds a bucket's members (kept whole on every rank). Used once: the
    wait takes the members out, so that nothing here keeps a restored object, and through it the gathered buffer,
    alive (Thunder's autograd context holds the saved non-tensors until the whole backward is done)."""

    members: tuple[payload.Member, ...]
    layout: BucketLayout

    def take(self) -> tuple[payload.Member, ...]:
        members, self.members = self.members, ()
        if not members:
            raise RuntimeError("ShardIntermediates: a sharded bucket was restored twice (backward run twice?)")
        return members


# ---- forward: keep 1/N of a bucket of replicated payloads ---------------------------------------------------------


def _shard_meta(objs, group, world_size: int, shard_nbytes: int, method: str, verify: bool, names):
    shard = TensorProxy(like=objs[0], shape=(shard_nbytes,), dtype=dtypes.uint8, requires_grad=False)
    return shard, AnyProxy(Restorer((), bucket_layout((), 1)), prefix="restore")  # the object only names the type


def _shard_impl(objs, group, world_size: int, shard_nbytes: int, method: str, verify: bool, names):
    with _annotate("fp8shard_shard"):
        buffers, members = [], []
        for obj, name in zip(objs, names):
            member_buffers, member = payload.take(obj)
            if verify:
                check_identical_across_ranks([payload.as_bytes(b) for b in member_buffers], group, name)
            buffers += member_buffers
            members.append(member)
        layout = bucket_layout([payload.nbytes(b) for b in buffers], world_size)
        device = buffers[0].device
        if method == "reduce_scatter":
            full = torch.zeros(layout.gathered_nbytes, dtype=torch.uint8, device=device)
            for b, off, size in zip(buffers, layout.offsets, layout.sizes):
                full[off : off + size].copy_(payload.as_bytes(b))
            shard = torch.empty(layout.shard_nbytes, dtype=torch.uint8, device=device)
            # identical replicas: MAX of equal bytes is those bytes
            dist.reduce_scatter_tensor(shard, full, op=dist.ReduceOp.MAX, group=group)
            return shard, Restorer(tuple(members), layout)
        # only the bytes this rank keeps are read; the copy is a fresh allocation, so the full buffers are freed
        # once the forward drops them
        pieces = layout.pieces(dist.get_rank(group))
        if len(pieces) == 1 and pieces[0][3] == 0 and pieces[0][2] - pieces[0][1] == layout.shard_nbytes:
            k, start, stop, _ = pieces[0]  # the common case: the shard is one slice of one buffer
            shard = payload.as_bytes(buffers[k])[start:stop].clone()
        else:  # several buffers, or the padded tail (padding and alignment gaps stay uninitialized)
            shard = torch.empty(layout.shard_nbytes, dtype=torch.uint8, device=device)
            for k, start, stop, at in pieces:
                shard[at : at + stop - start].copy_(payload.as_bytes(buffers[k])[start:stop])
        return shard, Restorer(tuple(members), layout)


shard = executor.register_operator("fp8shard_shard", meta=_shard_meta, fn=_shard_impl)


def check_identical_across_ranks(flats: list[torch.Tensor], group, name: str) -> None:
    """Raises on every rank if the ranks' payloads differ (all-gathers a SHA-256 digest of each rank's bytes)."""
    h = hashlib.sha256()
    for flat in flats:
        h.update(flat.detach().cpu().numpy().tobytes())
    mine = torch.tensor(list(h.digest()), dtype=torch.uint8, device=flats[0].device)
    everyone = torch.empty(dist.get_world_size(group) * mine.numel(), dtype=torch.uint8, device=mine.device)
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


class GatherHandle(NamedTuple):
    """An all-gather in flight: its work handle and the buffer it fills."""

    work: Any
    buffer: torch.Tensor


def _gather_start_meta(shard, group):
    return AnyProxy(GatherHandle(None, None), prefix="gather")  # the object only names the type


def _gather_start_impl(shard: torch.Tensor, group) -> GatherHandle:
    with _annotate("fp8shard_gather_start"):
        out = torch.empty(shard.numel() * dist.get_world_size(group), dtype=torch.uint8, device=shard.device)
        return GatherHandle(dist.all_gather_into_tensor(out, shard, group=group, async_op=True), out)


gather_start = executor.register_operator("fp8shard_gather_start", meta=_gather_start_meta, fn=_gather_start_impl)


def _gather_wait_meta(handle, restorer):
    raise NotImplementedError("fp8shard_gather_wait is bound by the rewrite with the restored proxies as its outputs")


def _gather_wait_impl(handle: GatherHandle, restorer: Restorer) -> tuple:
    with _annotate("fp8shard_gather_wait"):
        handle.work.wait()
        buf, layout = handle.buffer, restorer.layout
        out, k = [], 0
        for member in restorer.take():
            views = []
            for shape, dtype in member.buffers:
                off = layout.offsets[k]
                views.append(payload.from_bytes(buf[off : off + layout.sizes[k]], shape, dtype))
                k += 1
            out.append(payload.give(member, views))
        return tuple(out)


gather_wait = executor.register_operator("fp8shard_gather_wait", meta=_gather_wait_meta, fn=_gather_wait_impl)
