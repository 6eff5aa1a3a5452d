"""Payload kinds for TransformerEngine's quantized tensors (imported by :mod:`thunder_fp8shard.payload` when TE exists).

A TE quantized tensor is a wrapper around a few inner buffers. TE declares them on the storage class as
``_INNER_TENSORS`` (``(attribute, constructor keyword)`` pairs, TE >= 2.x) and rebuilds an object from the buffers
plus its non-tensor constructor keywords (``_flatten_nontensor_kwargs()``: quantizer, fp8 dtype, fake dtype, ...).
This module uses exactly that contract:

* the *large* buffers that are present (for ``Float8Tensor``: ``_data`` and/or ``_transpose``, uint8, one byte per
  element) are concatenated, flat, into the payload that the pass shards;
* everything else (the small ``_scale_inv`` kept whole and by reference, exactly as the unsharded saved tensor holds
  it; the quantizer, fp8 dtype, fake dtype, shape; which buffers were present, their shapes, dtypes and offsets) goes
  into the restore state, which every rank keeps;
* ``from_bytes`` cuts the gathered payload back into the buffers (views, no copy) and calls the same TE class's
  constructor with the same keywords.

Another TE storage type is one more subclass of :class:`_TEQuantizedPayload` naming its storage class and its large
constructor keywords, plus one line in :data:`_KIND_SPECS`; the pass does not change. ``MXFP8Tensor`` and
``Float8BlockwiseQTensor`` are declared below; only ``Float8Tensor`` (DelayedScaling) has run through the pass on the
GPU so far (MXFP8 needs compute capability 10, and Thunder's TE executor emits only Float8Tensor on Hopper).

Importing this module raises ``ImportError`` when TransformerEngine is not installed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import transformer_engine.pytorch.tensor.float8_tensor as _te_float8  # noqa: F401  (ImportError without TE)
from transformer_engine.pytorch.tensor.storage.float8_tensor_storage import Float8TensorStorage


@dataclass(frozen=True)
class BufferSlot:
    """One large inner buffer inside the flat payload."""

    kwarg: str  # the TE constructor keyword it is passed back as (e.g. "data_transpose")
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # byte offset in the flat payload
    nbytes: int


@dataclass(frozen=True)
class TEState:
    """Restore state of a TE quantized tensor: everything except the bytes of its large buffers."""

    cls: type
    is_wrapper: bool  # a torch.Tensor subclass (Float8Tensor) rather than a bare storage (Float8TensorStorage)
    shape: tuple[int, ...]  # the logical (high-precision) shape; wrappers only
    requires_grad: bool
    device: torch.device
    slots: tuple[BufferSlot, ...]  # large buffers present, in payload order
    kwargs: dict[str, Any]  # every other constructor keyword: small tensors (by reference), quantizer, dtypes, None's


def inner_buffers(obj: Any) -> list[tuple[str, str, torch.Tensor | None]]:
    """``(attribute, constructor keyword, tensor or None)`` for each inner buffer TE declares on ``type(obj)``."""
    return [(attr, kw, getattr(obj, attr, None)) for attr, kw in type(obj)._INNER_TENSORS]


class _TEQuantizedPayload:
    """Generic payload for a TE ``QuantizedTensorStorage`` subclass; subclasses set the three class attributes."""

    name: str = ""
    storage_cls: type = object
    large_kwargs: tuple[str, ...] = ()  # constructor keywords of the buffers that go (flat) into the payload

    def matches(self, obj: Any) -> bool:
        return isinstance(obj, self.storage_cls)

    def to_bytes(self, obj: Any) -> tuple[torch.Tensor, TEState]:
        cls = type(obj)
        kwargs = dict(obj._flatten_nontensor_kwargs())
        pieces: list[torch.Tensor] = []
        slots: list[BufferSlot] = []
        offset = 0
        device = None
        for _attr, kw, t in inner_buffers(obj):
            if t is not None and device is None:
                device = t.device
            if kw in self.large_kwargs and t is not None:
                flat = t.contiguous().reshape(-1).view(torch.uint8)
                slots.append(BufferSlot(kw, tuple(t.shape), t.dtype, offset, flat.numel()))
                pieces.append(flat)
                offset += flat.numel()
            else:
                kwargs[kw] = t  # small buffer (scale_inv) kept whole, by reference; or None
        if not pieces:
            raise ValueError(f"{cls.__qualname__} holds none of its large buffers {self.large_kwargs}: nothing to shard")
        is_wrapper = isinstance(obj, torch.Tensor)
        if device is None:
            device = obj.device
        flat = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        state = TEState(
            cls=cls, is_wrapper=is_wrapper, shape=tuple(obj.shape) if is_wrapper else (),
            requires_grad=bool(obj.requires_grad) if is_wrapper else False, device=device,
            slots=tuple(slots), kwargs=kwargs,
        )
        return flat, state

    def from_bytes(self, flat: torch.Tensor, state: TEState) -> Any:
        kwargs = dict(state.kwargs)
        for s in state.slots:
            kwargs[s.kwarg] = flat[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape)
        if not state.is_wrapper:
            return state.cls(**kwargs)
        return state.cls(
            shape=state.shape, dtype=kwargs.get("fake_dtype"), requires_grad=state.requires_grad,
            device=state.device, **kwargs,
        )


class TransformerEnginePayload(_TEQuantizedPayload):
    """TE ``Float8Tensor`` / ``Float8TensorStorage`` (DelayedScaling and current scaling): ``_data`` and
    ``_transpose`` (uint8) are the payload; ``_scale_inv`` (fp32[1]) stays whole."""

    name = "te_float8"
    storage_cls = Float8TensorStorage
    large_kwargs = ("data", "data_transpose")


def _optional_kind(module: str, cls_name: str, kind_name: str, large: tuple[str, ...]) -> type | None:
    """A payload class for a TE storage type that this TE version may not have."""
    try:
        mod = __import__(module, fromlist=[cls_name])
        storage = getattr(mod, cls_name)
    except (ImportError, AttributeError):
        return None
    return type(
        f"{cls_name}Payload", (_TEQuantizedPayload,),
        {"name": kind_name, "storage_cls": storage, "large_kwargs": large,
         "__doc__": f"TE {cls_name}: {', '.join(large)} are the payload; scale-inverses stay whole."},
    )


MXFP8Payload = _optional_kind(
    "transformer_engine.pytorch.tensor.storage.mxfp8_tensor_storage", "MXFP8TensorStorage", "te_mxfp8",
    ("rowwise_data", "columnwise_data"),
)
Float8BlockwisePayload = _optional_kind(
    "transformer_engine.pytorch.tensor.storage.float8_blockwise_tensor_storage", "Float8BlockwiseQTensorStorage",
    "te_float8_blockwise", ("rowwise_data", "columnwise_data"),
)

# the TE payload kinds besides TransformerEnginePayload that this TE version has; payload.py registers them all
EXTRA_KINDS = tuple(k() for k in (MXFP8Payload, Float8BlockwisePayload) if k is not None)

