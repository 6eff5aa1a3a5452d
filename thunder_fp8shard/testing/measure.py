"""Measuring what autograd really keeps for backward: distinct storages of the saved tensors, in bytes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from thunder_fp8shard.runtime.audit import storages  # the one storage walk (TE's quantized tensors: their buffers')


class SavedBytes:
    """Bytes of the distinct storages autograd packed while active. Storages are held and told apart by identity: by
    address a freed storage and a later one at the same address would count once."""

    def __init__(self) -> None:
        self._storages: dict[int, tuple[torch.UntypedStorage, int]] = {}
        self._total: int | None = None

    @property
    def total(self) -> int:
        if self._total is not None:
            return self._total
        return sum(nbytes for _, nbytes in self._storages.values())

    def add(self, t: torch.Tensor) -> None:
        for s in storages(t):
            self._storages.setdefault(id(s), (s, s.nbytes()))

    def close(self) -> None:
        """Keep the total, let go of the storages."""
        self._total = self.total
        self._storages.clear()


@contextlib.contextmanager
def saved_bytes() -> Iterator[SavedBytes]:
    """``with saved_bytes() as s: loss = model(x)``, then ``s.total`` is what that forward saved for backward."""
    record = SavedBytes()

    def pack(t):
        record.add(t)
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield record
    finally:
        record.close()
