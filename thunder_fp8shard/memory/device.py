"""What the device's allocator says while a cache entry compiles: the one place the pass reads device memory.
:func:`measure` reads ``memory_allocated``, then forces the program's kernel workspaces into existence (a tiny GEMM of
each kind, forward and backward: the backward's thread has its own cuBLAS handle) and records what each added; the
cuBLAS ones are released again, as the program recreates those it uses. Tests replace the :class:`DeviceProbe`."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from thunder.core.trace import TraceCtx

from thunder_fp8shard.analysis.program import program_device

CUBLAS = "cuBLAS"
TE_GEMM = "TransformerEngine GEMM"
# what a workspace that could not be forced is known to weigh, for the plan's reason
SIZE_HINTS = {TE_GEMM: "TE 2.x allocates 32 MiB (+ 1 KiB since 2.8) a device on compute capability >= 9.0, "
                       "4 MiB below"}


@dataclass(frozen=True)
class DeviceMemory:
    device: str  # e.g. "cuda:0"
    allocated_bytes: int  # before any workspace was forced
    workspaces: tuple[tuple[str, int], ...]  # (kind, bytes the allocator gained when it was forced)
    not_forced: tuple[tuple[str, str], ...] = ()  # (kind, why not): its bytes are unknown


# GEMMs on PyTorch's cuBLAS handles (top level or in a fusion region); TE's use its own workspace. Those with a bias go
# through cuBLASLt, a workspace of its own.
CUBLAS_GEMMS = frozenset({"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv", "mv", "einsum",
                          "tensordot", "_scaled_mm", "scaled_mm"})
BIAS_GEMMS = frozenset({"linear", "addmm", "baddbmm", "addbmm", "addmv", "_scaled_mm", "scaled_mm"})


def cublas_gemms(trace: TraceCtx) -> frozenset[str]:
    """The forward's GEMMs that are not TransformerEngine's, by name."""
    found: set[str] = set()
    todo = list(trace.bound_symbols)  # and the bound symbols of fusion regions
    while todo:
        bsym = todo.pop()
        if bsym.sym.name in CUBLAS_GEMMS:
            found.add(bsym.sym.name)
        elif bsym.sym.is_fusion:
            todo += bsym.subsymbols
    return frozenset(found)


def measure(trace: TraceCtx, *, transformer_engine: bool, cublas=("matmul",)) -> DeviceMemory | None:
    """Allocated and workspace bytes on the device of ``trace``'s inputs (None on the CPU)."""
    device = program_device(trace)
    if device is None or not torch.cuda.is_available():
        return None
    dev = torch.device(device)
    allocated = torch.cuda.memory_allocated(dev)
    with_bias = bool(BIAS_GEMMS.intersection(cublas))
    forces: list[tuple[str, Callable[[], object]]] = [(CUBLAS, lambda: _run_gemms(dev, with_bias))] if cublas else []
    if transformer_engine:
        forces.append((TE_GEMM, lambda: _te_workspace(dev)))
    workspaces, not_forced = [], []
    for kind, force in forces:
        grown, error = _growth(dev, force)
        if error is None:
            workspaces.append((kind, grown))
        else:
            not_forced.append((kind, f"{error}; {SIZE_HINTS[kind]}" if kind in SIZE_HINTS else error))
            warnings.warn(f"ShardIntermediates: could not force the {kind} workspace into existence ({error}); the "
                          "predicted peak leaves it out, and the plan says so", RuntimeWarning, stacklevel=2)
    if cublas:
        _release_cublas_workspaces()
    return DeviceMemory(device, allocated, tuple(workspaces), tuple(not_forced))


def _growth(dev: torch.device, force: Callable[[], object]) -> tuple[int, str | None]:
    """What the allocator gained while ``force`` ran, and None; or 0 and why it raised."""
    before = torch.cuda.memory_allocated(dev)
    try:
        with torch.cuda.device(dev):
            force()
    except Exception as e:  # an API this module does not know: reported, never counted as 0 bytes
        return 0, f"{type(e).__name__}: {e}"
    return max(torch.cuda.memory_allocated(dev) - before, 0), None


def _run_gemms(dev: torch.device, with_bias: bool) -> None:
    """A plain GEMM (cuBLAS) and, ``with_bias``, a linear with a bias (cuBLASLt), forward and backward."""
    with torch.enable_grad():
        w = torch.ones(16, 16, device=dev, dtype=torch.bfloat16, requires_grad=True)
        out = torch.matmul(w, w).sum()
        if with_bias:
            out = out + torch.nn.functional.linear(w, w, w[0]).sum()
        out.backward()
    del w, out


def _release_cublas_workspaces() -> None:
    """Releases PyTorch's cuBLAS workspaces to the caching allocator; the program recreates those it uses."""
    if (clear := getattr(torch._C, "_cuda_clearCublasWorkspaces", None)) is not None:
        clear()


def _te_workspace(dev: torch.device) -> object:
    """Creates (or finds) TransformerEngine's GEMM workspace on ``dev``. TE >= 2.10 caches it keyed on the positional
    arguments ``general_gemm`` passes, so these are the same; TE <= 2.9 keeps one module-level tensor."""
    try:
        from transformer_engine.pytorch.cpp_extensions.gemm import get_cublas_workspace
    except ImportError as new_api:
        try:
            from transformer_engine.pytorch.module.base import get_workspace
        except ImportError as old_api:
            raise ImportError(f"neither TE >= 2.10's API ({new_api}) nor TE <= 2.9's ({old_api})") from old_api
        return get_workspace()
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return get_cublas_workspace(int(index), False, False)


def peak_allocated(device: str | None) -> int | None:
    """``torch.cuda.max_memory_allocated`` of ``device`` (None on the CPU)."""
    if device is None or not torch.cuda.is_available():
        return None
    return torch.cuda.max_memory_allocated(torch.device(device))


def allocated(device: str | None) -> int | None:
    """``torch.cuda.memory_allocated`` of ``device`` (None on the CPU)."""
    return None if device is None or not torch.cuda.is_available() else torch.cuda.memory_allocated(torch.device(device))


def capacity(device: str | None) -> tuple[int, float, int] | None:
    """The device's total bytes, the fraction of them this process may allocate
    (``torch.cuda.set_per_process_memory_fraction``; 1.0 unless set; it limits the allocator's reserved bytes), and the
    reserved bytes' peak; None on the CPU."""
    if device is None or not torch.cuda.is_available():
        return None
    dev = torch.device(device)
    return (torch.cuda.get_device_properties(dev).total_memory, torch.cuda.get_per_process_memory_fraction(dev),
            torch.cuda.max_memory_reserved(dev))


class DeviceProbe:
    """What the pass reads of the device, injectable so a test can plant readings on the CPU."""

    def while_compiling(self, trace: TraceCtx, *, transformer_engine: bool,
                        cublas=("matmul",)) -> DeviceMemory | None:
        return measure(trace, transformer_engine=transformer_engine, cublas=cublas)

    def peak_allocated(self, device: str | None) -> int | None:
        return peak_allocated(device)

    def allocated(self, device: str | None) -> int | None:
        return allocated(device)

    def capacity(self, device: str | None) -> tuple[int, float, int] | None:
        return capacity(device)
