"""Byte layout of a bucket: members one after the other, each at a multiple of ``ALIGN``, padded to a multiple of ``k``.
Rank ``r`` keeps the ``r``-th slice, so one ``all_gather_into_tensor`` returns the layout and members come back as
views."""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

ALIGN = 256  # bytes; enough for any kernel (a fresh CUDA caching allocator block is 512-aligned)


@dataclass(frozen=True)
class BucketLayout:
    """Where each segment (one large buffer of one member) lies in the bucket's flat payload."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    k: int  # the shard group's size

    @property
    def nbytes(self) -> int:
        """Bytes of the payload with alignment gaps, before padding to a multiple of ``k``."""
        return self.offsets[-1] + self.sizes[-1] if self.sizes else 0

    @property
    def shard_nbytes(self) -> int:
        """Bytes each rank keeps."""
        return -(-self.nbytes // self.k)

    @property
    def gathered_nbytes(self) -> int:
        """Bytes of the all-gathered buffer."""
        return self.shard_nbytes * self.k

    def pieces(self, rank: int) -> tuple[tuple[int, int, int, int], ...]:
        """The parts of segments rank ``rank`` keeps: ``(segment, start, stop, offset in the shard)``."""
        lo, hi = rank * self.shard_nbytes, (rank + 1) * self.shard_nbytes
        clipped = ((seg, off, max(lo, off), min(hi, off + size))
                   for seg, (off, size) in enumerate(zip(self.offsets, self.sizes)))
        return tuple((seg, a - off, b - off, a - lo) for seg, off, a, b in clipped if a < b)


def bucket_layout(sizes: list[int] | tuple[int, ...], k: int) -> BucketLayout:
    """Lays out segments of ``sizes`` bytes, each at the next multiple of ``ALIGN`` (cached: the grouping repeats
    layouts)."""
    return _bucket_layout(tuple(int(s) for s in sizes), k)


@functools.lru_cache(maxsize=4096)
def _bucket_layout(sizes: tuple[int, ...], k: int) -> BucketLayout:
    if k < 1:
        raise ValueError(f"k (the shard group's size) must be positive, got {k}")
    offsets, end = [], 0
    for size in sizes:
        start = -(-end // ALIGN) * ALIGN
        offsets.append(start)
        end = start + size
    return BucketLayout(tuple(offsets), sizes, k)


def sources_layout(sizes: list[int] | tuple[int, ...]) -> BucketLayout:
    """The gathered buffer of a bucket whose members' shards are forward inputs: each member's gathered bytes at the
    next multiple of ``ALIGN``."""
    return bucket_layout(sizes, 1)


def packed_offsets(sizes: list[int] | tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """Offsets of segments packed back to back, and the total: how a shard op keeps its buckets' shards."""
    ends = tuple(itertools.accumulate((int(s) for s in sizes), initial=0))
    return ends[:-1], ends[-1]

