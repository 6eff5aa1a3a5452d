"""Byte layout of a bucket: several saved tensors sharded and all-gathered as one flat ``uint8`` buffer.

The members' large buffers are laid out one after the other, each starting at a multiple of ``ALIGN`` bytes (so a
member rebuilt as a view of the gathered buffer is as aligned as a fresh allocation for any dtype and for the
GEMMs that read it), and the whole is padded to a multiple of ``k``, the shard group's size. Rank ``r`` keeps bytes
``[r * shard_nbytes, (r + 1) * shard_nbytes)``; one ``all_gather_into_tensor`` of the shards returns the layout
itself, so every member comes back as a view, without a copy. Pure arithmetic: the planner uses it to count bytes
and the run-time operators to cut and rebuild (once a shard op, on its first call).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

ALIGN = 256  # bytes; what the CUDA caching allocator guarantees for a fresh block (512) is more than any kernel needs


@dataclass(frozen=True)
class BucketLayout:
    """Where each segment (one large buffer of one member) lies in the bucket's flat payload."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    k: int  # the shard group's size: ranks the payload is split over

    @property
    def nbytes(self) -> int:
        """Bytes of the laid-out payload, alignment gaps included, before padding to a multiple of ``k``."""
        return self.offsets[-1] + self.sizes[-1] if self.sizes else 0

    @property
    def shard_nbytes(self) -> int:
        """Bytes each rank keeps."""
        return -(-self.nbytes // self.k)

    @property
    def gathered_nbytes(self) -> int:
        """Bytes of the all-gathered buffer (the payload padded to a multiple of ``k``)."""
        return self.shard_nbytes * self.k

    def pieces(self, rank: int) -> tuple[tuple[int, int, int, int], ...]:
        """The parts of segments that rank ``rank`` keeps: ``(segment, start, stop, offset in the shard)``, where
        ``start:stop`` are byte positions inside the segment."""
        lo, hi = rank * self.shard_nbytes, (rank + 1) * self.shard_nbytes
        out = []
        for seg, (off, size) in enumerate(zip(self.offsets, self.sizes)):
            a, b = max(lo, off), min(hi, off + size)
            if a < b:
                out.append((seg, a - off, b - off, a - lo))
        return tuple(out)


def bucket_layout(sizes: list[int] | tuple[int, ...], k: int) -> BucketLayout:
    """Lays out segments of ``sizes`` bytes, each at the next multiple of ``ALIGN`` (cached: the grouping lays the
    same buckets out again while it tries groupings)."""
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
    """The gathered buffer of a bucket whose members' shards are forward inputs (their parameter shards), gathered
    by one coalesced all-gather: each member's whole gathered bytes (``sizes``: ``k`` times its input's) at the next
    multiple of ``ALIGN``, so that each comes back as a view."""
    return bucket_layout(sizes, 1)


def packed_offsets(sizes: list[int] | tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """Offsets of segments packed back to back, and the total: how one shard op keeps the shards of its buckets (no
    gaps, so the shard is one copy of its pieces and its bytes are exactly the shards'; the shards of real weights
    are multiples of 256 bytes anyway)."""
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += int(size)
    return tuple(offsets), end

