"""The saved-for-backward contract: the forward returns ``(outputs, (saved_tensors, saved_other))`` and the backward
takes ``[saved_tensors, saved_other]``, positionally."""

from __future__ import annotations

import math

from thunder.core.prims import PrimIDs
from thunder.core.proxies import Proxy, TensorProxy
from thunder.core.pytree import tree_flatten
from thunder.core.trace import TraceCtx


def forward_saved(fw: TraceCtx) -> tuple[list, list]:
    """The forward's saved tensors and saved other values, in order."""
    ret = fw.bound_symbols[-1]
    assert ret.sym.id == PrimIDs.RETURN, "the forward trace must end with its return"
    _, (saved_tensors, saved_other) = ret.args
    return list(saved_tensors), list(saved_other)


def backward_saved(bw: TraceCtx) -> tuple[list, list]:
    """The backward's saved tensors and saved other values, read from its arguments."""
    saved_tensors, saved_other = bw.args[0]
    return list(saved_tensors), list(saved_other)


def forward_inputs(fw: TraceCtx) -> list[Proxy]:
    """Every proxy among the forward's arguments (args, then kwargs, flattened), in order."""
    flat, _ = tree_flatten((fw.args, fw.kwargs))
    return [p for p in flat if isinstance(p, Proxy)]


def body_without_dels(trace: TraceCtx) -> list:
    """The trace's bound symbols but its dels (a rewrite makes them again)."""
    return [b for b in trace.bound_symbols if b.sym.id != PrimIDs.DEL]


def forward_outputs(fw: TraceCtx) -> list[Proxy]:
    """The proxies of the augmented forward's ``output`` and ``flat_output``, in order."""
    outputs, _ = fw.bound_symbols[-1].args
    if isinstance(outputs, dict):
        outputs = (outputs.get("output"), outputs.get("flat_output"))
    flat, _ = tree_flatten(outputs)
    return [p for p in flat if isinstance(p, Proxy)]


def numel(p: TensorProxy) -> int:
    """The element count of ``p``'s shape, without ``TensorProxy.numel``: slow, and after Thunder FSDP rewrites
    ``_shape`` still the unsharded count."""
    shape = getattr(p, "_shape", None)
    if type(shape) is tuple and all(type(s) is int for s in shape):
        return math.prod(shape)
    return int(p.numel)


def tensor_nbytes(p: TensorProxy) -> int:
    return int(numel(p) * p.dtype.bytes)
