"""What the device's allocator says while a cache entry compiles: the one place the pass reads device memory.

:func:`measure` runs in the pass's forward hook, i.e. inside the first call of a new input shape, before the
program runs. It reads ``torch.cuda.memory_allocated`` (everything alive then: parameter shards, the batch, and at
a later compilation the optimizer's state), then forces the workspaces of the program's kernels into existence and
records what each one added: cuBLAS keeps one per handle and stream, and the autograd engine runs the backward on
its own thread (its own handle), so a tiny linear layer is run forward and backward; TransformerEngine keeps one
GEMM workspace (asked for when the program has TE ops). A workspace that already existed adds 0 bytes and is in
``allocated_bytes`` instead. On the CPU (no CUDA tensor among the program's inputs) nothing is measured.

Each rank measures its own device, so the figures differ between ranks; the plan is made with the largest over the
ranks (:mod:`thunder_fp8shard.agreement`). The transform calls :func:`measure` through its module's name, which
is where a test plants figures for a CPU run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from thunder.core.proxies import TensorProxy
from thunder.core.pytree import tree_flatten
from thunder.core.trace import TraceCtx

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceMemory:
    device: str  # e.g. "cuda:0"
    allocated_bytes: int  # torch.cuda.memory_allocated(device) before any workspace was forced
    workspaces: tuple[tuple[str, int], ...]  # (kind, bytes the allocator gained when it was forced into existence)


def program_device(trace: TraceCtx) -> str | None:
    """The CUDA device of the program's first CUDA tensor input, e.g. ``"cuda:0"``; None if it has none."""
    for p in tree_flatten((trace.args, trace.kwargs))[0]:
        if isinstance(p, TensorProxy) and p.device.type == "cuda":
            return p.device.device_str()
    return None


def measure(trace: TraceCtx, *, transformer_engine: bool) -> DeviceMemory | None:
    """Allocated bytes and the workspaces' bytes on the device of ``trace``'s inputs (None on the CPU)."""
    device = program_device(trace)
    if device is None or not torch.cuda.is_available():
        return None
    dev = torch.device(device)
    allocated = torch.cuda.memory_allocated(dev)
    workspaces = [("cuBLAS", _growth(dev, lambda: _run_linear(dev)))]
    if transformer_engine:
        workspaces.append(("TransformerEngine GEMM", _growth(dev, _te_workspace)))
    return DeviceMemory(device, allocated, tuple(workspaces))


def _growth(dev: torch.device, force: Callable[[], None]) -> int:
    before = torch.cuda.memory_allocated(dev)
    try:
        with torch.cuda.device(dev):
            force()
    except Exception as e:  # a missing API counts 0, and says so in the log
        log.warning("ShardIntermediates: could not force a workspace (%s); it counts 0 bytes", e)
        return 0
    return max(torch.cuda.memory_allocated(dev) - before, 0)


def _run_linear(dev: torch.device) -> None:
    """A linear layer with bias (cuBLASLt) and its backward (cuBLAS, on the autograd engine's thread); everything it
    allocates but the workspaces is freed on return."""
    with torch.enable_grad():
        w = torch.ones(16, 16, device=dev, dtype=torch.bfloat16, requires_grad=True)
        torch.nn.functional.linear(w, w, w[0]).sum().backward()
    del w


def _te_workspace() -> None:
    from transformer_engine.pytorch.module.base import get_workspace

    get_workspace()
