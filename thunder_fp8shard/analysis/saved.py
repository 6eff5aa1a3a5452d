"""Reading the saved-for-backward contract between a forward trace and its backward trace.

The forward returns ``(outputs, (saved_tensors, saved_other))``; the backward takes ``(saved_for_backward,
cotangents)`` with ``saved_for_backward == [saved_tensors, saved_other]``, positionally (see Thunder's
``thunder/transforms/autodiff.py``).
"""

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
    """The backward's saved tensors and saved other values (read from its arguments, never from the unpacks)."""
    saved_tensors, saved_other = bw.args[0]
    return list(saved_tensors), list(saved_other)


def forward_inputs(fw: TraceCtx) -> list[Proxy]:
    """Every proxy among the forward's arguments (its args, then its kwargs, flattened), in order: the one rule for
    a trace's inputs (a compilation reads them once, :attr:`thunder_fp8shard.analysis.program.ProgramFacts.args`)."""
    flat, _ = tree_flatten((fw.args, fw.kwargs))
    return [p for p in flat if isinstance(p, Proxy)]


def forward_outputs(fw: TraceCtx) -> list[Proxy]:
    """The proxies of the augmented forward's ``output`` and ``flat_output``, in order (its ``flat_args`` are its
    inputs): the one rule for the forward's outputs."""
    outputs, _ = fw.bound_symbols[-1].args
    if isinstance(outputs, dict):
        outputs = (outputs.get("output"), outputs.get("flat_output"))
    flat, _ = tree_flatten(outputs)
    return [p for p in flat if isinstance(p, Proxy)]


def model_io_names(fw: TraceCtx) -> set[str]:
    """Names of the forward's inputs and outputs: they are kept alive by the caller, sharding them frees nothing."""
    return {p.name for p in forward_inputs(fw)} | {p.name for p in forward_outputs(fw)}


def numel(p: TensorProxy) -> int:
    """The number of elements of ``p``'s shape, without Thunder's method lookup (``TensorProxy.numel`` resolves
    through ``__getattr__`` and the language context on every access, which dominates a pass over every tensor of a
    large trace). Computed from the shape, not from the proxy's cached ``_numel``: Thunder's FSDP transform shards
    the parameter proxies by rewriting their ``_shape`` only, so their ``_numel`` (and ``numel``) still count the
    unsharded parameter."""
    shape = getattr(p, "_shape", None)
    if type(shape) is tuple and all(type(s) is int for s in shape):
        return math.prod(shape)
    return int(p.numel)


def tensor_nbytes(p: TensorProxy) -> int:
    return int(numel(p) * p.dtype.bytes)
