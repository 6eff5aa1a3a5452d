"""Run-time operators the rewrite inserts: small Thunder operators (meta + Python implementation), one call per bucket.

Forward:  ``shard, r1, ..., rb = fp8shard_shard(((t1, ..., tk), ...), group, world_size, shard_nbytes, method, verify,
          names)``: one call keeps this rank's shards of ``b`` buckets in one tensor (packed back to back), and a
          restorer per bucket.
Backward: ``handle = fp8shard_gather_start(shard, offset, nbytes, group)`` (issues one bucket's all-gather) and later
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
from thunder_fp8shard.layout import BucketLayout, bucket_layout, packed_offsets

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


# ---- forward: keep 1/N of one or more buckets of replicated payloads ------------------------------------------------


def _shard_meta(buckets, group, world_size: int, shard_nbytes: int, method: str, verify: bool, names):
    shard = TensorProxy(like=buckets[0][0], shape=(shard_nbytes,), dtype=dtypes.uint8, requires_grad=False)
    restorers = (AnyProxy(Restorer((), bucket_layout((), 1)), prefix="restore") for _ in buckets)  # names the type
    return (shard, *restorers)


def _shard_impl(buckets, group, world_size: int, shard_nbytes: int, method: str, verify: bool, names):
    with _annotate("fp8shard_shard"):
        restorers, all_buffers = [], []
        for objs, bucket_names in zip(buckets, names):
            buffers, members = [], []
            for obj, name in zip(objs, bucket_names):
                member_buffers, member = payload.take(obj)
                if verify:
                    check_identical_across_ranks([payload.as_bytes(b) for b in member_buffers], group, name)
                buffers += member_buffers
                members.append(member)
            restorers.append(Restorer(tuple(members), bucket_layout([payload.nbytes(b) for b in buffers], world_size)))
            all_buffers.append(buffers)
        offsets, total = packed_offsets([r.layout.shard_nbytes for r in restorers])  # each bucket's shard
        if total != shard_nbytes:
            raise RuntimeError(f"ShardIntermediates: the shard op's payload is {total:,} B a rank, the plan "
                               f"said {shard_nbytes:,} B (did a saved tensor change shape or dtype?)")
        device = all_buffers[0][0].device
        if method == "reduce_scatter":
            shard = torch.empty(shard_nbytes, dtype=torch.uint8, device=device)
            for r, buffers, at in zip(restorers, all_buffers, offsets):
                full = torch.zeros(r.layout.gathered_nbytes, dtype=torch.uint8, device=device)
                for b, off, size in zip(buffers, r.layout.offsets, r.layout.sizes):
                    full[off : off + size].copy_(payload.as_bytes(b))
                # identical replicas: MAX of equal bytes is those bytes
                dist.reduce_scatter_tensor(shard[at : at + r.layout.shard_nbytes], full, op=dist.ReduceOp.MAX,
                                           group=group)
            return (shard, *restorers)
        # only the bytes this rank keeps are read; the copy is a fresh allocation, so the full buffers are freed
        # once the forward drops them. The common case is one copy kernel: the pieces tile the shard exactly.
        rank = dist.get_rank(group)
        pieces, tiled = [], 0  # (source bytes, offset in the shard)
        for r, buffers, at in zip(restorers, all_buffers, offsets):
            for k, start, stop, off in r.layout.pieces(rank):
                pieces.append((payload.as_bytes(buffers[k])[start:stop], at + off))
        for src, off in pieces:
            tiled = tiled + src.numel() if off == tiled else -1
        if tiled == shard_nbytes:
            shard = pieces[0][0].clone() if len(pieces) == 1 else torch.cat([src for src, _ in pieces])
        else:  # the padded tail, or alignment gaps (left uninitialized: they are never read back)
            shard = torch.empty(shard_nbytes, dtype=torch.uint8, device=device)
            for src, off in pieces:
                shard[off : off + src.numel()].copy_(src)
        return (shard, *restorers)


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


def _gather_start_meta(shard, offset: int, nbytes: int, group):
    return AnyProxy(GatherHandle(None, None), prefix="gather")  # the object only names the type


def _gather_start_impl(shard: torch.Tensor, offset: int, nbytes: int, group) -> GatherHandle:
    with _annotate("fp8shard_gather_start"):
        mine = shard if nbytes == shard.numel() else shard[offset : offset + nbytes]
        out = torch.empty(nbytes * dist.get_world_size(group), dtype=torch.uint8, device=shard.device)
        return GatherHandle(dist.all_gather_into_tensor(out, mine, group=group, async_op=True), out)


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
