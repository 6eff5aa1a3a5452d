"""Measuring what autograd really keeps for backward (distinct storages of the saved tensors, in bytes) and a CPU step's
allocation peak (the profiler's allocation events)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from thunder_fp8shard.runtime.audit import storages  # the one storage walk (TE's quantized tensors: their buffers')


class SavedBytes:
    """Bytes of the distinct storages autograd packed while active. Storages are held and told apart by identity: by
    address a freed storage and a later one at the same address would count once."""

    def __init__(self) -> None:
        self._storages: dict[int, tuple[torch.UntypedStorage, int]] = {}
        self._total: int | None = None

    @property
    def total(self) -> int:
        if self._total is not None:
            return self._total
        return sum(nbytes for _, nbytes in self._storages.values())

    def add(self, t: torch.Tensor) -> None:
        for s in storages(t):
            self._storages.setdefault(id(s), (s, s.nbytes()))

    def close(self) -> None:
        """Keep the total, let go of the storages."""
        self._total = self.total
        self._storages.clear()


@contextlib.contextmanager
def saved_bytes() -> Iterator[SavedBytes]:
    """``with saved_bytes() as s: loss = model(x)``, then ``s.total`` is what that forward saved for backward."""
    record = SavedBytes()

    def pack(t):
        record.add(t)
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield record
    finally:
        record.close()


def allocation_peak(prof) -> int:
    """The most bytes tensors allocated while ``prof`` recorded held at once (frees matched by address; frees of earlier
    blocks left out)."""
    from torch._C._profiler import _EventType

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation:
            events.append((e.start_time_ns, int(e.extra_fields.alloc_size), int(e.extra_fields.ptr)))
        stack.extend(e.children)
    live: dict[int, int] = {}
    now = peak = 0
    for _, size, ptr in sorted(events, key=lambda ev: ev[0]):
        if size > 0:
            live[ptr] = size
            now += size
            peak = max(peak, now)
        elif ptr in live:
            now -= live.pop(ptr)
    return peak


class CpuPeak:
    bytes: int = 0  # set when the block ends


@contextlib.contextmanager
def cpu_peak() -> Iterator[CpuPeak]:
    """``with cpu_peak() as p: step()``, then ``p.bytes`` is the most bytes the tensors allocated on the CPU inside held
    at once (:func:`allocation_peak`; there is no device allocator to ask on the CPU)."""
    from torch.profiler import ProfilerActivity, profile

    # Kineto logs "gpuGetDeviceCount failed" at its start where torch's CUDA libraries find no GPU; one cycle only, so
    # acc_events changes nothing but torch's warning that events are cleared at the end of each
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    record = CpuPeak()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, acc_events=True) as prof:
        yield record
    record.bytes = allocation_peak(prof)
