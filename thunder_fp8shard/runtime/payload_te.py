"""Payload kinds for TransformerEngine's quantized tensors (imported by :mod:`thunder_fp8shard.runtime.payload` when TE exists).

A TE quantized tensor is a wrapper around a few inner buffers, which TE declares on the storage class as
``_INNER_TENSORS`` (``(attribute, constructor keyword)`` pairs, TE >= 2.x). This kind uses exactly that contract:

* ``take`` hands over the *large* buffers that are present (for ``Float8Tensor``: ``_data`` and/or ``_transpose``,
  uint8, one byte per element) and sets those attributes to ``None``. The object itself, with its small
  ``_scale_inv``, its quantizer, dtypes and flags untouched, is the restore state that every rank keeps.
* ``give`` puts the views of the gathered bytes back into the same attributes and returns the same object. Nothing
  is constructed in backward, and the backward sees the object exactly as the forward left it.

Another TE storage type is one more subclass of :class:`_TEQuantizedPayload` naming its storage class and its large
constructor keywords; the pass does not change. ``MXFP8Tensor`` and ``Float8BlockwiseQTensor`` are declared below;
only ``Float8Tensor`` (DelayedScaling) has run through the pass on the GPU so far (MXFP8 needs compute capability 10,
and Thunder's TE executor emits only Float8Tensor on Hopper).

Importing this module raises ``ImportError`` when TransformerEngine is not installed.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

import transformer_engine.pytorch.tensor.float8_tensor as _te_float8  # noqa: F401  (ImportError without TE)
from transformer_engine.pytorch.tensor.storage.float8_tensor_storage import Float8TensorStorage


@functools.lru_cache(maxsize=None)
def _large_attributes(cls: type, large_kwargs: tuple[str, ...]) -> tuple[str, ...]:
    """The attributes of the inner buffers of ``cls`` whose constructor keywords are ``large_kwargs`` (TE declares
    them on the class: the same for every object, so asked once a type rather than once a saved tensor)."""
    return tuple(attr for attr, kw in cls._INNER_TENSORS if kw in large_kwargs)


class _TEQuantizedPayload:
    """Generic payload for a TE ``QuantizedTensorStorage`` subclass; subclasses set the three class attributes."""

    name: str = ""
    storage_cls: type = object
    large_kwargs: tuple[str, ...] = ()  # constructor keywords of the buffers that are sharded

    def matches(self, obj: Any) -> bool:
        return isinstance(obj, self.storage_cls)

    def take(self, obj: Any) -> tuple[list[torch.Tensor], tuple[Any, tuple[str, ...]]]:
        buffers, attrs = [], []
        for attr in _large_attributes(type(obj), self.large_kwargs):
            t = getattr(obj, attr, None)
            if t is not None:
                buffers.append(t)
                attrs.append(attr)
                setattr(obj, attr, None)
        if not buffers:
            raise ValueError(f"{type(obj).__qualname__} holds none of its large buffers {self.large_kwargs}: nothing to shard")
        return buffers, (obj, tuple(attrs))

    def give(self, state: tuple[Any, tuple[str, ...]], buffers: list[torch.Tensor]) -> Any:
        obj, attrs = state
        for attr, t in zip(attrs, buffers):
            setattr(obj, attr, t)
        return obj


class TransformerEnginePayload(_TEQuantizedPayload):
    """TE ``Float8Tensor`` / ``Float8TensorStorage`` (DelayedScaling and current scaling): ``_data`` and
    ``_transpose`` (uint8) are the payload; ``_scale_inv`` (fp32[1]) stays with the object."""

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

