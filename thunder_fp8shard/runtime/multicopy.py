"""Many byte copies in one device launch: the forward's shard op copies this rank's pieces of its buffers and its
compact copies of saved views with one kernel, whatever their number.

A copy is an :class:`Item`: ``planes x rows`` runs of ``n`` contiguous bytes read at the given strides and written
back to back. Where a CUDA device and NVRTC are there, :class:`Copies` compiles one kernel (once a process and device)
and launches it through the driver with a table of the items' addresses, filled in place each call. Elsewhere (the
CPU, gloo) there is no :class:`Copies` and the caller copies with torch.
"""

from __future__ import annotations

import ctypes
import logging
from typing import NamedTuple

import torch

log = logging.getLogger(__name__)

MAX_ITEMS = 32  # a launch's table: 32 items of 7 8-byte fields, within the driver's 4 KiB of kernel parameters
_FIELDS = 7
_THREADS = 256

_SOURCE = r"""
struct Item { unsigned long long src, dst, n, rows, planes, row_stride, plane_stride; };
struct Table { Item items[%(max)d]; };

template <typename V>
__device__ void strided(const Item& it, unsigned long long tid, unsigned long long step) {
  const unsigned long long w = it.n / sizeof(V), per_plane = it.rows * w, total = it.planes * per_plane;
  V* d = (V*)it.dst;
  for (unsigned long long i = tid; i < total; i += step) {
    const unsigned long long p = i / per_plane, q = i - p * per_plane, r = q / w, c = q - r * w;
    d[i] = *(const V*)(it.src + p * it.plane_stride + r * it.row_stride + c * sizeof(V));
  }
}

extern "C" __global__ void __launch_bounds__(%(threads)d) fp8shard_copy(Table t) {
  const Item it = t.items[blockIdx.y];
  const unsigned long long tid = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
  const unsigned long long step = gridDim.x * (unsigned long long)blockDim.x;
  if (it.rows == 1 && it.planes == 1 && ((it.src ^ it.dst) & 15) == 0) {  // one run: bytes, 16-byte words, bytes
    unsigned long long head = (16 - (it.src & 15)) & 15;
    if (head > it.n) head = it.n;
    const unsigned long long words = (it.n - head) / 16, tail = head + words * 16;
    const uint4* s = (const uint4*)(it.src + head);
    uint4* d = (uint4*)(it.dst + head);
    for (unsigned long long i = tid; i < words; i += step) d[i] = s[i];
    for (unsigned long long i = tid; i < head; i += step) ((unsigned char*)it.dst)[i] = ((const unsigned char*)it.src)[i];
    for (unsigned long long i = tail + tid; i < it.n; i += step)
      ((unsigned char*)it.dst)[i] = ((const unsigned char*)it.src)[i];
    return;
  }
  const unsigned long long a = it.src | it.dst | it.n | it.row_stride | it.plane_stride;
  if ((a & 15) == 0) strided<uint4>(it, tid, step);
  else if ((a & 3) == 0) strided<unsigned int>(it, tid, step);
  else strided<unsigned char>(it, tid, step);
}
""" % {"max": MAX_ITEMS, "threads": _THREADS}


class Item(NamedTuple):
    """``planes x rows`` runs of ``n`` bytes: run ``(p, r)`` starts ``p * plane_stride + r * row_stride`` bytes after
    the source's first byte; the destination is dense."""

    n: int
    rows: int = 1
    planes: int = 1
    row_stride: int = 0
    plane_stride: int = 0

    @property
    def nbytes(self) -> int:
        return self.n * self.rows * self.planes


def strided_item(shape, stride, element_size: int) -> Item | None:
    """A view's bytes as an :class:`Item` read in its strides' order (its dense copy's order); None where its
    innermost dimension is not contiguous or more than three runs of dimensions remain after merging."""
    dims = sorted(((size, st) for size, st in zip(shape, stride) if size != 1), key=lambda d: -d[1])
    merged: list[list[int]] = []  # [size, stride] from the outermost; adjacent ones merged where dense
    for size, st in dims:
        if merged and merged[-1][1] == st * size:
            merged[-1] = [merged[-1][0] * size, st]
        else:
            merged.append([size, st])
    if not merged:
        return Item(element_size)
    if merged[-1][1] != 1 or len(merged) > 3:
        return None
    (n, _), *outer = reversed(merged)
    rows, row_stride = outer[0] if outer else (1, 0)
    planes, plane_stride = outer[1] if len(outer) > 1 else (1, 0)
    return Item(n * element_size, rows, planes, row_stride * element_size, plane_stride * element_size)


class _Kernel:
    """The compiled copy kernel of one device and the driver's launch function."""

    def __init__(self, device: torch.device):
        with torch.cuda.device(device):
            self.compiled = torch.cuda._compile_kernel(_SOURCE, "fp8shard_copy")  # holds the module loaded
            self.func = self.compiled.func
            self.blocks = 4 * torch.cuda.get_device_properties(device).multi_processor_count
        lib = ctypes.CDLL("libcuda.so.1")
        self.launch = lib.cuLaunchKernel
        self.launch.argtypes = [ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self.launch.restype = ctypes.c_int
        self.index = device.index if device.index is not None else torch.cuda.current_device()


_KERNELS: dict[torch.device, _Kernel | None] = {}


def kernel(device: torch.device) -> _Kernel | None:
    """The copy kernel of ``device`` (None: not a CUDA device, or it cannot be compiled there; said once)."""
    if device in _KERNELS:
        return _KERNELS[device]
    k = None
    if device.type == "cuda":
        try:
            k = _Kernel(device)
        except Exception as e:  # no NVRTC, no driver entry point: torch copies, as on the CPU
            log.warning("ShardIntermediates: the one-launch copy kernel is unavailable on %s (%s); copying with "
                        "torch, one call a copy", device, e)
    _KERNELS[device] = k
    return k


class Copies:
    """One call site's copies on one device, whose shapes stay while the call site's program does: each call fills
    the table with the items' source and destination addresses and launches the kernel once (once a
    :data:`MAX_ITEMS`)."""

    __slots__ = ("items", "kernel", "_launches")

    def __init__(self, items: list[Item], k: _Kernel):
        self.items, self.kernel, self._launches = tuple(items), k, []
        for lo in range(0, len(self.items), MAX_ITEMS):
            chunk = self.items[lo : lo + MAX_ITEMS]
            table = (ctypes.c_uint64 * (_FIELDS * MAX_ITEMS))()
            for i, it in enumerate(chunk):
                table[_FIELDS * i + 2 : _FIELDS * i + 7] = list(it)
            params = (ctypes.c_void_p * 1)(ctypes.addressof(table))
            words = max(it.nbytes for it in chunk) // 16 + 1
            grid = max(1, min(-(-words // _THREADS), k.blocks))
            self._launches.append((table, params, lo, len(chunk), grid))

    @classmethod
    def on(cls, items: list[Item], device: torch.device) -> Copies | None:
        """The copies of ``items`` on ``device``; None where it has no copy kernel (copy with torch)."""
        k = kernel(device)
        return None if k is None else cls(items, k)

    def __call__(self, sources: list[int], destinations: list[int]) -> None:
        """Copies item ``i`` from address ``sources[i]`` to address ``destinations[i]``, on the current stream."""
        k = self.kernel
        stream = torch._C._cuda_getCurrentRawStream(k.index)
        for table, params, lo, n, grid in self._launches:
            for i in range(n):
                table[_FIELDS * i] = sources[lo + i]
                table[_FIELDS * i + 1] = destinations[lo + i]
            err = k.launch(k.func, grid, n, 1, _THREADS, 1, 1, 0, stream, params, None)
            if err:
                raise RuntimeError(f"ShardIntermediates: the copy kernel's launch failed (CUDA driver error {err})")
