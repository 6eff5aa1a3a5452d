"""Run-time payloads: which buffers of a saved object are sharded, and how the object gets them back.

A payload kind ``take``\\ s an object apart into its large buffers (sharded) and a small restore state (kept whole
on every rank), and ``give``\\ s it back from views of the gathered bytes. After ``take`` the pass references no
large buffer, so they are freed as soon as the forward drops the object. Plain tensors are one kind; TE's quantized
tensors another (:mod:`thunder_fp8shard.runtime.payload_te`); :func:`register_payload_kind` adds more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


class PayloadKind(Protocol):
    name: str

    def matches(self, obj: Any) -> bool:
        """Whether this kind handles ``obj``; decided by its type alone (cached by type)."""

    def take(self, obj: Any) -> tuple[list[torch.Tensor], Any]:
        """The object's large buffers, and the state that rebuilds it from them; ``obj`` must not be used after."""

    def give(self, state: Any, buffers: list[torch.Tensor]) -> Any:
        """The object rebuilt from ``state`` and tensors equal to the buffers ``take`` returned."""


@dataclass(frozen=True)
class Member:
    """One saved object of a bucket, taken apart."""

    kind: str
    state: Any
    buffers: tuple[tuple[tuple[int, ...], torch.dtype], ...]


class PlainTensorPayload:
    """A dense torch tensor: its own bytes; it comes back as a view."""

    name = "tensor"

    def matches(self, obj: Any) -> bool:
        return type(obj) is torch.Tensor or type(obj) is torch.nn.Parameter

    def take(self, obj: torch.Tensor) -> tuple[list[torch.Tensor], Any]:
        return [obj], None

    def give(self, state: Any, buffers: list[torch.Tensor]) -> torch.Tensor:
        return buffers[0]


PLAIN = PlainTensorPayload()  # the run-time operators handle it inline
_KINDS: list[PayloadKind] = [PLAIN]
_BY_NAME: dict[str, PayloadKind] = {k.name: k for k in _KINDS}
BY_TYPE: dict[type, PayloadKind] = {}  # kind_of's cache


def register_payload_kind(kind: PayloadKind) -> None:
    """Adds a payload kind; it is tried before those registered earlier."""
    _KINDS.insert(0, kind)
    _BY_NAME[kind.name] = kind
    BY_TYPE.clear()


def unregister_payload_kind(name: str) -> None:
    """Removes the payload kind named ``name``."""
    _KINDS[:] = [k for k in _KINDS if k.name != name]
    _BY_NAME.pop(name)
    BY_TYPE.clear()


def kind_of(obj: Any) -> PayloadKind:
    """The payload kind that handles ``obj``: the most recently registered that matches its type."""
    kind = BY_TYPE.get(type(obj))
    if kind is None:
        kind = next((k for k in _KINDS if k.matches(obj)), None)
        if kind is None:
            raise TypeError(
                f"ShardIntermediates: no payload kind handles a saved object of type {type(obj).__qualname__}; "
                "register one with thunder_fp8shard.runtime.payload.register_payload_kind"
            )
        BY_TYPE[type(obj)] = kind
    return kind


def take(obj: Any) -> tuple[list[torch.Tensor], Member]:
    """The large buffers of ``obj`` and the :class:`Member` that rebuilds it."""
    kind = kind_of(obj)
    buffers, state = kind.take(obj)
    return buffers, Member(kind.name, state, tuple((tuple(b.shape), b.dtype) for b in buffers))


def give(member: Member, buffers: list[torch.Tensor]) -> Any:
    return _BY_NAME[member.kind].give(member.state, buffers)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes in contiguous order as a flat ``uint8`` tensor (a view when contiguous)."""
    t = t.contiguous().view(-1)
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


try:  # only where TransformerEngine is installed
    from thunder_fp8shard.runtime.payload_te import EXTRA_KINDS, TransformerEnginePayload
except ImportError:
    pass
else:
    for _kind in (*EXTRA_KINDS, TransformerEnginePayload()):
        register_payload_kind(_kind)
