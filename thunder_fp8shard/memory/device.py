"""What the device's allocator says while a cache entry compiles: the one place the pass reads device memory.

:func:`measure` runs in the pass's forward hook, i.e. inside the first call of a new input shape, before the
program runs. It reads ``torch.cuda.memory_allocated`` (everything alive then: parameter shards, the batch, and at
a later compilation the optimizer's state), then forces the workspaces of the program's kernels into existence and
records what each one added. cuBLAS keeps one per handle and stream, and the autograd engine runs the backward on its
own thread (its own handle), so where the program has GEMMs that are not TransformerEngine's
(:func:`cublas_gemms`; forcing them otherwise would allocate workspaces the program never uses) a tiny GEMM
of the same kind is run forward and backward: a plain one (``matmul``, ``bmm``: cuBLAS), and a linear layer with a
bias (cuBLASLt) only where the program has such GEMMs. The cuBLAS workspaces are then released
(``torch._C._cuda_clearCublasWorkspaces``, as torch's own tests do before counting memory): the program creates
again those it uses, so the pass leaves none of its own making behind (a workspace it left would raise every later
step's memory; measured in docs/memory_model.md). TransformerEngine
keeps one cuBLAS workspace per device for its GEMMs (asked for when the program has TE ops; see
:func:`_te_workspace`), which its GEMMs reuse: it stays. All are allocated through PyTorch's caching allocator, so
``memory_allocated`` (and ``max_memory_allocated``) see them. A workspace that already existed adds 0 bytes and is
in ``allocated_bytes`` instead. A workspace that could not be forced (an API this module does not know) is listed in
``not_forced`` with the reason, and a warning is issued: the plan then says that the predicted peak leaves it out.
On the CPU (no CUDA tensor among the program's inputs) nothing is measured.

Each rank measures its own device, so the figures differ between ranks; the plan is made with the largest over the
ranks (:mod:`thunder_fp8shard.distributed.agreement`). The pass reads the device through a :class:`DeviceProbe` (this
module's functions), which a test replaces with its own to plant figures for a CPU run.
"""

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
    allocated_bytes: int  # torch.cuda.memory_allocated(device) before any workspace was forced
    workspaces: tuple[tuple[str, int], ...]  # (kind, bytes the allocator gained when it was forced into existence)
    not_forced: tuple[tuple[str, str], ...] = ()  # (kind, why it could not be forced): its bytes are unknown


# the GEMMs that run on PyTorch's cuBLAS handles (the names of Thunder's torch-level symbols, at the top level or
# inside a fusion region); TransformerEngine's own (``te_functional_linear_*``) use its workspace instead. Those
# with a bias go through cuBLASLt (a workspace of its own where torch keeps one).
CUBLAS_GEMMS = frozenset({"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv", "mv", "einsum",
                          "tensordot", "_scaled_mm", "scaled_mm"})
BIAS_GEMMS = frozenset({"linear", "addmm", "baddbmm", "addbmm", "addmv", "_scaled_mm", "scaled_mm"})


def cublas_gemms(trace: TraceCtx) -> frozenset[str]:
    """The GEMMs of ``trace`` (the forward: its backward's GEMMs are the gradients of these) that are not
    TransformerEngine's, at the top level or inside a fusion region, by name."""
    found: set[str] = set()

    def visit(bsym) -> None:
        if bsym.sym.name in CUBLAS_GEMMS:
            found.add(bsym.sym.name)
        elif bsym.sym.is_fusion:
            for b in bsym.subsymbols:
                visit(b)

    for b in trace.bound_symbols:
        visit(b)
    return frozenset(found)


def measure(trace: TraceCtx, *, transformer_engine: bool, cublas=("matmul",)) -> DeviceMemory | None:
    """Allocated bytes and the workspaces' bytes on the device of ``trace``'s inputs (None on the CPU): cuBLAS's for
    the GEMMs named in ``cublas`` (the program's that are not TransformerEngine's: :func:`cublas_gemms`; none: not
    forced), released again once measured, and TE's where ``transformer_engine``."""
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
    """A plain GEMM (cuBLAS) and, ``with_bias``, a linear layer with a bias (cuBLASLt), forward and backward (on the
    autograd engine's thread); everything they allocate but the workspaces is freed on return."""
    with torch.enable_grad():
        w = torch.ones(16, 16, device=dev, dtype=torch.bfloat16, requires_grad=True)
        out = torch.matmul(w, w).sum()
        if with_bias:
            out = out + torch.nn.functional.linear(w, w, w[0]).sum()
        out.backward()
    del w, out


def _release_cublas_workspaces() -> None:
    """Releases PyTorch's cuBLAS (and cuBLASLt) workspaces to the caching allocator: those the program uses are made
    again at its first GEMM on each handle and stream (measured above, so the model counts them)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def _te_workspace(dev: torch.device) -> object:
    """Creates (or finds) the cuBLAS workspace TransformerEngine's GEMMs use on ``dev`` and returns it.

    - TE >= 2.10: ``transformer_engine.pytorch.cpp_extensions.gemm.get_cublas_workspace(device, ub, grouped_gemm)``,
      an ``lru_cache`` of ``torch.empty(get_cublas_workspace_size_bytes(), dtype=uint8)``: 32 MiB + 1 KiB on compute
      capability >= 9 (Hopper), 4 MiB below. ``general_gemm`` (the path of ``BasicLinear``, which Thunder's TE
      executor calls) asks for ``(tensor.device.index, False, False)`` positionally; the cache key must be the
      same, so it is called positionally with an int and two bools. The userbuffers (``ub``: 3 x the size) and
      grouped-GEMM (one per cuBLAS stream) workspaces are created only by paths Thunder does not take.
    - TE <= 2.9: ``transformer_engine.pytorch.module.base.get_workspace()``, one module-level tensor of the same
      size (32 MiB without the 1 KiB before 2.8) on the current device (set by the caller).
    """
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


class DeviceProbe:
    """What the pass reads of the device: what the allocator holds while a program compiles (:func:`measure`, the
    forward hook), and its peak at the calibration step (:func:`peak_allocated`,
    :class:`~thunder_fp8shard.runtime.audit.Calibration`). Injected into the transform
    (``ShardIntermediates.inject(device_probe=...)``): a test gives its own to plant readings on the CPU."""

    def while_compiling(self, trace: TraceCtx, *, transformer_engine: bool,
                        cublas=("matmul",)) -> DeviceMemory | None:
        return measure(trace, transformer_engine=transformer_engine, cublas=cublas)

    def peak_allocated(self, device: str | None) -> int | None:
        return peak_allocated(device)
