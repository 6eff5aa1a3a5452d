"""Payload kinds for TransformerEngine's quantized tensors; importing raises ``ImportError`` without TE.

A TE quantized tensor wraps inner buffers that TE declares as ``_INNER_TENSORS``. ``take`` hands over the large ones
present and sets them to ``None``; the object itself, with its small scale-inverse and quantizer, is the restore
state. ``give`` puts views of the gathered bytes back, so the backward sees the object as the forward left it and
nothing is constructed. Another TE storage type is one more subclass of :class:`_TEQuantizedPayload`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

import transformer_engine.pytorch.tensor.float8_tensor as _te_float8  # noqa: F401  (ImportError without TE)
from transformer_engine.pytorch.tensor.storage.float8_tensor_storage import Float8TensorStorage


@functools.lru_cache(maxsize=None)
def _large_attributes(cls: type, large_kwargs: tuple[str, ...]) -> tuple[str, ...]:
    """The attributes of the inner buffers of ``cls`` whose constructor keywords are ``large_kwargs`` (asked
    once a type)."""
    return tuple(attr for attr, kw in cls._INNER_TENSORS if kw in large_kwargs)


class _TEQuantizedPayload:
    """Generic payload for a TE ``QuantizedTensorStorage`` subclass; subclasses set the three class attributes."""

    name: str = ""
    storage_cls: type = object
    large_kwargs: tuple[str, ...] = ()  # of the buffers that are sharded

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
    """TE ``Float8Tensor`` / ``Float8TensorStorage``: ``_data`` and ``_transpose`` are the payload;
    ``_scale_inv`` stays with the object."""

    name = "te_float8"
    storage_cls = Float8TensorStorage
    large_kwargs = ("data", "data_transpose")


def _optional_kind(module: str, cls_name: str, kind_name: str) -> type | None:
    """A payload class for a TE storage type that this TE version may not have: its row- and columnwise data are the
    payload."""
    try:
        mod = __import__(f"transformer_engine.pytorch.tensor.storage.{module}", fromlist=[cls_name])
        storage = getattr(mod, cls_name)
    except (ImportError, AttributeError):
        return None
    large = ("rowwise_data", "columnwise_data")
    return type(
        f"{cls_name}Payload", (_TEQuantizedPayload,),
        {"name": kind_name, "storage_cls": storage, "large_kwargs": large,
         "__doc__": f"TE {cls_name}: {', '.join(large)} are the payload; scale-inverses stay whole."},
    )


# those this TE version has
EXTRA_KINDS = tuple(k() for k in (_optional_kind("mxfp8_tensor_storage", "MXFP8TensorStorage", "te_mxfp8"),
                                  _optional_kind("float8_blockwise_tensor_storage", "Float8BlockwiseQTensorStorage",
                                                 "te_float8_blockwise")) if k is not None)
