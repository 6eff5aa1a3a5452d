"""Candidate discovery: which saved-for-backward tensors the pass may consider, and their real payload size."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from thunder.core import dtypes
from thunder.core.proxies import TensorProxy
from thunder.core.trace import TraceCtx

from thunder_fp8shard.analysis.names import TE_LINEAR_FWD, TE_SCALE_UPDATE
from thunder_fp8shard.analysis.saved import numel, tensor_nbytes

FLOAT8 = "float8"  # a tensor with a torch float8 dtype
TE_FLOAT8 = "te_float8"  # TransformerEngine quantized tensor; its proxy prints the high-precision dtype
TENSOR = "tensor"  # any other tensor (candidates="all", or "auto" where its shard is an input already)
# candidates="auto": below this, a tensor whose shard is an input (analysis.own_shards) costs a collective a step for
# too little memory
AUTO_INPUT_SHARD_MIN_BYTES = 1 << 20


@dataclass(frozen=True)
class Candidate:
    """A saved-for-backward tensor the pass considers; ``payload_bytes`` is what it occupies per rank."""

    proxy: TensorProxy
    kind: str
    payload_bytes: int

    @property
    def name(self) -> str:
        return self.proxy.name


def find_candidates(saved: Sequence[TensorProxy], candidates: str, te_quantized: set[str]) -> list[Candidate]:
    """The saved tensors that are FP8 (``candidates="fp8"``) or all of them (``"all"``), each once."""
    found: dict[str, Candidate] = {}
    for p in saved:
        kind = TE_FLOAT8 if p.name in te_quantized else FLOAT8 if p.dtype in dtypes.float_8bit_dtypes else TENSOR
        if p.name not in found and (kind != TENSOR or candidates == "all"):
            found[p.name] = Candidate(p, kind, payload_nbytes(p, te_quantized))
    return list(found.values())


def payload_nbytes(p: TensorProxy, te_quantized: set[str]) -> int:
    """What ``p`` really occupies: 1 byte an element for a TE quantized tensor, else its shape's bytes."""
    return numel(p) if p.name in te_quantized else tensor_nbytes(p)


def te_quantized_names(trace: TraceCtx) -> set[str]:
    """Proxies holding TE quantized tensors: outputs 1 and 2 of the TE linear forward and the scale update's tokens
    carrying them."""
    quantized: set[str] = set()
    for bsym in trace.bound_symbols:
        name = bsym.sym.name
        if name.startswith(TE_LINEAR_FWD):
            quantized.update(p.name for p in bsym.output[1:])
        elif name.startswith(TE_SCALE_UPDATE):
            quantized.update(out.name for out, token in zip(bsym.output, bsym.kwargs.get("tokens", ()))
                             if token.name in quantized)
    return quantized


def saved_bytes_by_dtype(saved: Sequence[TensorProxy], te_quantized: set[str]) -> dict[str, int]:
    """The payload bytes of the saved tensors (each once) by dtype, largest first: what a plan without candidates
    names."""
    by: dict[str, int] = {}
    for p in {p.name: p for p in saved if isinstance(p, TensorProxy)}.values():
        key = str(p.dtype).removeprefix("thunder.dtypes.")
        by[key] = by.get(key, 0) + payload_nbytes(p, te_quantized)
    return dict(sorted(by.items(), key=lambda kv: -kv[1]))
