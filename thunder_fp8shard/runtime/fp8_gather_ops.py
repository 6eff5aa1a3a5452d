"""Run-time operators of ``fp8_forward_gather`` (:mod:`thunder_fp8shard.rewrite.fp8_gather`): two, so that
the host-bound forward makes about one call per eligible weight where Thunder made three or four.

``fp8shard_weight_gather_starts`` casts this rank's valid rows of each weight with a rowwise-only copy of the linear's
    quantizer (the rows' amax is all-reduced before the scale update) and starts the uint8 all-gathers.
``fp8shard_te_linear_fwd`` wraps the gathered bytes as a TE ``Float8Tensor`` and calls the TE linear Thunder called.

Where the recipe or quantizer no longer qualifies, the start gathers the bf16 shard as FSDP did and TE casts. The
recipe is process-global and set alike on every rank, so every rank falls back alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from thunder.core.proxies import AnyProxy, TensorProxy

from thunder_fp8shard.runtime.ops import _ASYNC, executor

_float8_tensor = None  # TE's Float8Tensor class, imported lazily


class WeightGatherSpec:
    """One weight's constants, made by the rewrite, and the rowwise quantizer copy made at the first call
    (again only for a new quantizer object)."""

    __slots__ = ("group", "world_size", "rank", "rows", "valid_rows", "out_features", "in_features", "dtype",
                 "weight", "linear", "padded", "trimmed", "_copy_of", "_copy", "_cast")

    def __init__(self, group, world_size: int, rank: int, rows: int, valid_rows: int, out_features: int,
                 in_features: int, dtype: torch.dtype, weight: str = "", linear: Callable | None = None):
        if not 0 < valid_rows <= rows or world_size * rows < out_features:
            raise ValueError(f"fp8 forward gather of {weight}: {valid_rows} valid of {rows} rows a rank, {world_size} "
                             f"ranks, {out_features} rows in all")
        self.group, self.world_size, self.rank, self.rows, self.valid_rows = group, world_size, rank, rows, valid_rows
        self.out_features, self.in_features, self.dtype, self.weight = out_features, in_features, dtype, weight
        self.linear = linear
        self.padded = valid_rows != rows  # this rank's shard has padding rows
        self.trimmed = world_size * rows != out_features  # the gathered buffer has padding rows
        self._copy_of, self._copy, self._cast = None, None, None

    def rowwise_copy(self, quantizer):
        """A shallow copy of ``quantizer`` (same ``scale`` and ``amax``) that casts rowwise only into TE's
        internal storage, or None where ``quantizer`` is not a non-internal ``Float8Quantizer`` (the fallback).
        Kept for the next call with the same quantizer."""
        global _float8_tensor
        if self._copy_of is not quantizer:
            q = None
            if type(quantizer).__name__ == "Float8Quantizer" and not getattr(quantizer, "internal", False):
                q = quantizer.copy()
                q.set_usage(rowwise=True, columnwise=False)
                q.internal = True
                if _float8_tensor is None:
                    from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor

                    _float8_tensor = Float8Tensor
            self._copy_of, self._copy, self._cast = quantizer, q, None if q is None else q.quantize_impl
        return self._copy

    def __str__(self) -> str:
        return (f"{self.weight}: {self.out_features}x{self.in_features}, {self.valid_rows} of {self.rows} rows on rank "
                f"{self.rank} of {self.world_size}")


class GatherBatch:
    """The specs of one ``fp8shard_weight_gather_starts`` call, and the last recipe checked, so that an
    unchanged recipe costs one identity test a call."""

    __slots__ = ("specs", "_recipe", "_recipe_ok")

    def __init__(self, specs):
        self.specs = tuple(specs)
        self._recipe, self._recipe_ok = None, False

    def recipe_ok(self, recipe) -> bool:
        if recipe is not self._recipe:
            self._recipe, self._recipe_ok = recipe, exact_recipe(recipe) is None
        return self._recipe_ok

    def __str__(self) -> str:
        return f"{len(self.specs)} weight(s): " + "; ".join(map(str, self.specs))

    def collective_text(self) -> str:
        """The all-gathers of the call, the same on every rank."""
        return "; ".join(f"{s.rows}x{s.in_features} over {s.world_size}" for s in self.specs)


class WeightGatherHandle(NamedTuple):
    work: Any
    buf: torch.Tensor | None  # uint8 (fp8) or bf16 (fallback), [N*c, in]
    scale_inv: torch.Tensor | None  # None: fallback
    fp8_dtype: Any
    quantizer: Any
    send: torch.Tensor | None = None  # kept alive until the wait


def exact_recipe(recipe) -> str | None:
    """None where ``recipe`` makes the FP8 forward gather exact (DelayedScaling with ``reduce_amax``), else
    why not."""
    if recipe is None:
        return "no FP8 recipe"
    if type(recipe).__name__ != "DelayedScaling":
        return (f"the FP8 recipe is {type(recipe).__name__}, not DelayedScaling (block scales cross the shard rows, or "
                "a current scale is computed from the whole weight)")
    if not getattr(recipe, "reduce_amax", False):
        return ("DelayedScaling(reduce_amax=False): each rank would keep its own rows' amax and the ranks' scales "
                "would diverge")
    return None


def start_one(shard: torch.Tensor, quantizer, fp8: bool, spec: WeightGatherSpec) -> WeightGatherHandle:
    """One weight's start: cast this rank's valid rows and all-gather the uint8 bytes, or on the fallback
    start FSDP's bf16 all-gather."""
    q = spec.rowwise_copy(quantizer) if fp8 else None
    n, c, cols = spec.world_size, spec.rows, spec.in_features
    if q is None:  # fallback: FSDP's bf16 all-gather
        buf = shard.new_empty((n * c, cols))
        send = shard.contiguous()
        return WeightGatherHandle(spec.group._allgather_base(buf, send, _ASYNC), buf, None, None, None, send)
    if spec.padded:  # padding rows (uninitialized memory) never enter the amax nor the bytes
        cast = spec._cast(shard[: spec.valid_rows])
        send = torch.zeros((c, cols), dtype=torch.uint8, device=shard.device)
        send[: spec.valid_rows].copy_(cast._data.view(torch.uint8))
    else:
        cast = spec._cast(shard)
        send = cast._data if cast._data.dtype is torch.uint8 else cast._data.view(torch.uint8)
    buf = torch.empty((n * c, cols), dtype=torch.uint8, device=shard.device)
    work = spec.group._allgather_base(buf, send, _ASYNC)
    return WeightGatherHandle(work, buf, cast._scale_inv, cast._fp8_dtype, quantizer, send)


def _starts_meta(shards, quantizers, recipes, batch):
    return tuple(AnyProxy(WeightGatherHandle(None, None, None, None, None), prefix="wgather") for _ in shards)


def _starts(shards, quantizers, recipes, batch: GatherBatch) -> tuple[WeightGatherHandle, ...]:
    return tuple(start_one(t, q, batch.recipe_ok(r), spec)
                 for t, q, r, spec in zip(shards, quantizers, recipes, batch.specs))


weight_gather_starts = executor.register_operator("fp8shard_weight_gather_starts", meta=_starts_meta, fn=_starts)

def gathered_weight(handle: WeightGatherHandle, spec: WeightGatherSpec):
    """Waits for ``handle``'s all-gather and returns the full weight: a TE ``Float8Tensor`` (fp8) or the
    unpadded bf16 weight (fallback)."""
    handle.work.wait()
    full = handle.buf[: spec.out_features] if spec.trimmed else handle.buf
    if handle.scale_inv is None:  # fallback
        return full
    return _float8_tensor(shape=full.shape, dtype=spec.dtype, data=full, fp8_scale_inv=handle.scale_inv,
                          fp8_dtype=handle.fp8_dtype, data_transpose=None, quantizer=handle.quantizer,
                          requires_grad=False, device=full.device)


def to_columnwise(qw, w8) -> None:
    """Keeps only the columnwise copy of ``qw``, as TE does to a weight it quantized itself. TE returns a
    weight it was given unchanged, so where ``qw`` is the gathered ``w8`` do it here."""
    if qw is w8 and hasattr(qw, "update_usage"):
        qw.update_usage(rowwise_usage=False, columnwise_usage=True)


def _linear_meta(a, handle, bias, input_quantizer, weight_quantizer, spec):
    from thunder.core import dtypes

    w = TensorProxy(like=a, shape=(spec.out_features, spec.in_features), dtype=dtypes.to_dtype(spec.dtype))
    return TensorProxy(like=a, shape=(*a.shape[:-1], spec.out_features)), TensorProxy(like=a), w


def _linear(a, handle: WeightGatherHandle, bias, input_quantizer, weight_quantizer, spec: WeightGatherSpec):
    w = gathered_weight(handle, spec)
    y, qa, qw = spec.linear(a, w, bias, input_quantizer, weight_quantizer)
    to_columnwise(qw, w)
    return y, qa, qw


te_linear_fwd = executor.register_operator("fp8shard_te_linear_fwd", meta=_linear_meta, fn=_linear)

OPERATORS = (weight_gather_starts, te_linear_fwd)
