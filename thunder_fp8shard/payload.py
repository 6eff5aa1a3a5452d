"""Run-time payloads: the bytes of a saved tensor that are sharded, and how to rebuild the tensor from them.

A payload kind turns a saved object into one flat ``uint8`` buffer (the large part, sharded across ranks) and a
``Restorer`` (the small part: shape, dtype, scales, quantizer; kept whole on every rank), and back. Plain tensors of
any dtype (float8 included) are one kind; TransformerEngine's quantized tensors are another
(:mod:`thunder_fp8shard.payload_te`). Register further kinds (MXFP8, blockwise) with :func:`register_payload_kind`;
the pass itself does not change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class Restorer:
    """What, besides the gathered bytes, rebuilds a saved object: ``kind`` names the payload kind that made it."""

    kind: str
    nbytes: int  # unpadded length of the flat payload
    state: Any  # kind-specific: shape and dtype for plain tensors, metadata for quantized tensors


class PayloadKind(Protocol):
    name: str

    def matches(self, obj: Any) -> bool: ...

    def to_bytes(self, obj: Any) -> tuple[torch.Tensor, Any]:
        """A flat, contiguous ``uint8`` tensor (may be a view of ``obj``) and the kind-specific restore state."""

    def from_bytes(self, flat: torch.Tensor, state: Any) -> Any:
        """The object rebuilt from its full flat payload (exactly ``nbytes`` long) and its restore state."""


class PlainTensorPayload:
    """A dense, contiguous-able torch tensor: its bytes, reinterpreted as ``uint8`` (no copy when contiguous)."""

    name = "tensor"

    def matches(self, obj: Any) -> bool:
        return type(obj) is torch.Tensor or type(obj) is torch.nn.Parameter

    def to_bytes(self, obj: torch.Tensor) -> tuple[torch.Tensor, Any]:
        flat = obj.contiguous().reshape(-1).view(torch.uint8)
        return flat, (tuple(obj.shape), obj.dtype)

    def from_bytes(self, flat: torch.Tensor, state: Any) -> torch.Tensor:
        shape, dtype = state
        return flat.view(dtype).reshape(shape)


_KINDS: list[PayloadKind] = [PlainTensorPayload()]
_BY_NAME: dict[str, PayloadKind] = {k.name: k for k in _KINDS}


def register_payload_kind(kind: PayloadKind) -> None:
    """Adds a payload kind; it is tried before those registered earlier."""
    _KINDS.insert(0, kind)
    _BY_NAME[kind.name] = kind


def to_bytes(obj: Any) -> tuple[torch.Tensor, Restorer]:
    for kind in _KINDS:
        if kind.matches(obj):
            flat, state = kind.to_bytes(obj)
            if flat.dtype != torch.uint8 or flat.dim() != 1:
                raise TypeError(f"payload kind {kind.name!r} returned {flat.dtype} of shape {tuple(flat.shape)}")
            return flat, Restorer(kind.name, flat.numel(), state)
    raise TypeError(
        f"ShardIntermediates: no payload kind handles a saved object of type {type(obj).__qualname__}; "
        "register one with thunder_fp8shard.payload.register_payload_kind"
    )


def from_bytes(flat: torch.Tensor, restorer: Restorer) -> Any:
    return _BY_NAME[restorer.kind].from_bytes(flat[: restorer.nbytes], restorer.state)


try:  # TransformerEngine's quantized tensors exist only where TransformerEngine is installed
    from thunder_fp8shard.payload_te import EXTRA_KINDS, TransformerEnginePayload
except ImportError:
    pass
else:
    for _kind in (*EXTRA_KINDS, TransformerEnginePayload()):
        register_payload_kind(_kind)
