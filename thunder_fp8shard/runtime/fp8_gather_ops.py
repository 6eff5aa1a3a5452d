"""Run-time operators of ``fp8_forward_gather`` (see :mod:`thunder_fp8shard.fp8_gather` for where they go and why
the result is bitwise today's).

Forward, per eligible TE linear weight, replacing FSDP's bf16 ``all_gather`` + ``wait`` (+ unpad slice):

``h = fp8shard_weight_gather_start(shard, q_w, recipe, spec)``
    casts this rank's valid rows of its parameter shard with a rowwise-only shallow copy of the linear's weight
    quantizer (the same ``scale``; the kernel maxes the rows' amax into ``amax_history[0][1]``, which
    ``te_fp8_amax_and_scale_update`` all-reduces with MAX before the scale update) and issues the uint8 all-gather
    of the FP8 bytes over FSDP's group.
``w8 = fp8shard_weight_gather_wait(h, spec)``
    waits and returns the full weight as a TE ``Float8Tensor`` (rowwise bytes of the gathered buffer, the scale-inverse
    TE's kernel wrote for the shard), which TE's linear forward takes as is (no second cast).
``fp8shard_weight_to_columnwise(qw, w8)``
    right after that forward: ``qw.update_usage(rowwise=False, columnwise=True)``, what TE does to a weight it
    quantized itself, so the saved copy has today's layout (``_transpose`` only, from ``tex.fp8_transpose``).

Run-time fallback: where the recipe is not DelayedScaling with ``reduce_amax``, or the quantizer not a
``Float8Quantizer`` (the recipe changed after compilation), or an ``internal`` one (TE's own cast would return a bare
storage, not the Float8Tensor the wait builds), the start op all-gathers the bf16 shard as FSDP did and
the wait returns the unpadded bf16 weight, which TE casts as today. The recipe is process-global and set by the same
user code on every rank, so every rank falls back alike (the collectives still match: one all-gather either way).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from thunder.core.proxies import AnyProxy, TensorProxy
from torch.distributed.distributed_c10d import AllgatherOptions

from thunder_fp8shard.runtime.ops import executor

_ASYNC = AllgatherOptions()
_ASYNC.asyncOp = True


class WeightGatherSpec:
    """One weight's constants, made by the rewrite: FSDP's group, its size N and this rank's rank in it, the shard's
    rows ``c`` (``ceil(out/N)``) and this rank's valid rows among them, the full weight's shape and nominal dtype;
    and the rowwise-only quantizer copy, made at the first call (per quantizer object)."""

    __slots__ = ("group", "world_size", "rank", "rows", "valid_rows", "out_features", "in_features", "dtype",
                 "weight", "_copy_of", "_copy")

    def __init__(self, group, world_size: int, rank: int, rows: int, valid_rows: int, out_features: int,
                 in_features: int, dtype: torch.dtype, weight: str = ""):
        if not 0 < valid_rows <= rows or world_size * rows < out_features:
            raise ValueError(f"fp8 forward gather of {weight}: {valid_rows} valid of {rows} rows a rank, {world_size} "
                             f"ranks, {out_features} rows in all")
        self.group, self.world_size, self.rank, self.rows, self.valid_rows = group, world_size, rank, rows, valid_rows
        self.out_features, self.in_features, self.dtype, self.weight = out_features, in_features, dtype, weight
        self._copy_of, self._copy = None, None

    def rowwise_copy(self, quantizer):
        """A shallow copy of ``quantizer`` (same ``scale`` and ``amax`` tensors) that casts rowwise only and returns
        TE's internal storage; ``quantizer``'s own usage flags are never touched."""
        if self._copy_of is not quantizer:
            q = quantizer.copy()
            q.set_usage(rowwise=True, columnwise=False)
            q.internal = True
            self._copy_of, self._copy = quantizer, q
        return self._copy

    def __str__(self) -> str:
        return (f"{self.weight}: {self.out_features}x{self.in_features}, {self.valid_rows} of {self.rows} rows on rank "
                f"{self.rank} of {self.world_size}")


class WeightGatherHandle(NamedTuple):
    work: Any  # the all-gather's work object
    buf: torch.Tensor | None  # the gathered buffer: uint8 [N*c, in] (fp8) or the bf16 [N*c, in] (fallback)
    scale_inv: torch.Tensor | None  # fp8: the shard cast's scale-inverse (written by TE's kernel); None: fallback
    fp8_dtype: Any
    quantizer: Any  # fp8: the linear's weight quantizer (the Float8Tensor's, as TE's own cast would record it)
    send: torch.Tensor | None = None  # what this rank sent, kept alive until the wait


def exact_recipe(recipe) -> str | None:
    """None where ``recipe`` makes the FP8 forward gather bitwise today's (DelayedScaling with ``reduce_amax``), else
    why not. Used at compile time (the plan's note) and at each call (the fallback)."""
    if recipe is None:
        return "no FP8 recipe"
    if type(recipe).__name__ != "DelayedScaling":
        return (f"the FP8 recipe is {type(recipe).__name__}, not DelayedScaling (block scales cross the shard rows, or "
                "a current scale is computed from the whole weight)")
    if not getattr(recipe, "reduce_amax", False):
        return ("DelayedScaling(reduce_amax=False): each rank would keep its own rows' amax and the ranks' scales "
                "would diverge")
    return None


def _is_float8_quantizer(q) -> bool:
    return type(q).__name__ == "Float8Quantizer"


def _start_meta(shard, quantizer, recipe, spec):
    return AnyProxy(WeightGatherHandle(None, None, None, None, None), prefix="wgather")  # the object names the type


def _start(shard: torch.Tensor, quantizer, recipe, spec: WeightGatherSpec) -> WeightGatherHandle:
    n, c, cols = spec.world_size, spec.rows, spec.in_features
    # TE's own cast of the weight returns a Float8Tensor (the quantizer not ``internal``): the wait builds one too
    if (exact_recipe(recipe) is not None or not _is_float8_quantizer(quantizer)
            or getattr(quantizer, "internal", False)):
        buf = shard.new_empty((n * c, cols))  # FSDP's bf16 all-gather, as it was
        send = shard.contiguous()
        return WeightGatherHandle(spec.group._allgather_base(buf, send, _ASYNC), buf, None, None, None, send)
    q = spec.rowwise_copy(quantizer)(shard[: spec.valid_rows])  # padding rows (uninitialized) never enter the amax
    data = q._data
    if spec.valid_rows != c:
        send = torch.zeros((c, cols), dtype=torch.uint8, device=shard.device)
        send[: spec.valid_rows].copy_(data.view(torch.uint8))
    else:
        send = data.view(torch.uint8)
    buf = torch.empty((n * c, cols), dtype=torch.uint8, device=shard.device)
    work = spec.group._allgather_base(buf, send, _ASYNC)
    return WeightGatherHandle(work, buf, q._scale_inv, q._fp8_dtype, quantizer, send)


weight_gather_start = executor.register_operator("fp8shard_weight_gather_start", meta=_start_meta, fn=_start)


def _wait_meta(handle, spec):
    from thunder.core import devices, dtypes

    return TensorProxy(shape=(spec.out_features, spec.in_features), dtype=dtypes.to_dtype(spec.dtype),
                       device=devices.to_device("cuda"), requires_grad=False)


def _wait(handle: WeightGatherHandle, spec: WeightGatherSpec):
    handle.work.wait()
    full = handle.buf[: spec.out_features]
    if handle.scale_inv is None:  # fallback: the bf16 weight, FSDP's unpad slice
        return full
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor

    return Float8Tensor(shape=full.shape, dtype=spec.dtype, data=full, fp8_scale_inv=handle.scale_inv,
                        fp8_dtype=handle.fp8_dtype, data_transpose=None, quantizer=handle.quantizer,
                        requires_grad=False, device=full.device)


weight_gather_wait = executor.register_operator("fp8shard_weight_gather_wait", meta=_wait_meta, fn=_wait)


def _to_columnwise_meta(qw, w8):
    return None


def _to_columnwise(qw, w8) -> None:
    # TE returns the weight it was given (``w is weight``) and keeps its rowwise bytes; a weight it quantized itself it
    # turns columnwise-only (basic_linear.py, "Prepare weight tensor for backward pass"): do the same. On the
    # fallback TE quantized it, and already did.
    if qw is w8 and hasattr(qw, "update_usage"):
        qw.update_usage(rowwise_usage=False, columnwise_usage=True)


weight_to_columnwise = executor.register_operator("fp8shard_weight_to_columnwise", meta=_to_columnwise_meta,
                                                  fn=_to_columnwise)

OPERATORS = (weight_gather_start, weight_gather_wait, weight_to_columnwise)
