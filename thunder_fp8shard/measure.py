"""Measuring what autograd really keeps for backward: distinct storages of the saved tensors, in bytes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

# inner buffers of TransformerEngine's quantized tensors (wrapper subclasses without storage of their own)
_INNER_BUFFERS = ("_data", "_transpose", "_scale_inv", "_rowwise_data", "_columnwise_data", "_rowwise_scale_inv",
                  "_columnwise_scale_inv")


class SavedBytes:
    """Bytes of the distinct storages packed by autograd while the context was active."""

    def __init__(self) -> None:
        self._storages: dict[int, int] = {}

    @property
    def total(self) -> int:
        return sum(self._storages.values())

    def add(self, t: torch.Tensor) -> None:
        for s in _storages(t):
            self._storages[s.data_ptr()] = s.nbytes()


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    if type(t) in (torch.Tensor, torch.nn.Parameter):
        return [t.untyped_storage()]
    inner = [getattr(t, a, None) for a in _INNER_BUFFERS]
    found = [s for b in inner if isinstance(b, torch.Tensor) for s in _storages(b)]
    return found or [t.untyped_storage()]


@contextlib.contextmanager
def saved_bytes() -> Iterator[SavedBytes]:
    """``with saved_bytes() as s: loss = model(x)`` then ``s.total`` is what that forward saved for backward."""
    record = SavedBytes()

    def pack(t):
        record.add(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield record
