"""The model's layout: what every program of one model runs collectively. A rank may compile a program alone (a short
last batch), so every later compilation realizes the layout the ranks agreed at the first, without a collective: the
same tensors by structural key, in the same buckets. A program proves it by its :func:`signature`, every collective it
issues; one that cannot raises before any of them runs."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from thunder.core.proxies import AnyProxy, TensorProxy
from thunder.core.pytree import tree_flatten
from thunder.core.trace import TraceCtx

from thunder_fp8shard.analysis.identity import _constant
from thunder_fp8shard.analysis.names import COLLECTIVES, TE_SCALE_UPDATE
from thunder_fp8shard.plan import ShardPlan

PASS_COLLECTIVES = ("fp8shard_shard", "fp8shard_gather_start", "fp8shard_gather_next", "fp8shard_weight_gather_starts")


@dataclass(frozen=True)
class Layout:
    """What every program of a model runs collectively: sharded tensors by key, buckets, shard ops, the rewrite whose
    variant of the program runs ("": none), and its collectives."""

    buckets: tuple[tuple[str, ...], ...] = ()
    shard_ops: tuple[int, ...] = ()
    variant: str = ""
    signature: tuple[str, ...] = ()

    @property
    def digest(self) -> bytes:
        text = "\n".join([repr(self.buckets), repr(self.shard_ops), repr(self.variant), *self.signature])
        return hashlib.sha256(text.encode()).digest()

    def fields(self) -> list[tuple[str, str]]:
        """The layout as ``(field, value)`` pairs, for the error naming what differs between ranks."""
        return [("variant", self.variant or "none"), ("buckets", str(len(self.buckets))),
                *((f"bucket {j}", f"{len(b)} tensor(s) of shard op {op}") for j, (b, op) in
                  enumerate(zip(self.buckets, self.shard_ops))),
                ("collectives", str(len(self.signature))),
                *((f"collective {i}", c) for i, c in enumerate(self.signature))]


def layout_of(plan: ShardPlan, keys: Mapping[str, str], variant: str, sig: tuple[str, ...]) -> Layout:
    """The layout of ``plan`` (made on a program whose tensors have ``keys``)."""
    return Layout(tuple(tuple(keys[n] for n in b.members) for b in plan.buckets),
                  tuple(b.shard_op for b in plan.buckets), variant, sig)


def _arg(x) -> str:
    if isinstance(x, TensorProxy):
        return f"{str(x.dtype).removeprefix('thunder.dtypes.')}{list(x.shape)}"
    if isinstance(x, AnyProxy):
        return "-"
    text = getattr(x, "collective_text", None)
    return text() if callable(text) else _constant(x)


def describe(bsym) -> str | None:
    """One collective operator call as the same text on every rank (None: ``bsym`` runs no collective)."""
    name = bsym.sym.name
    if name.startswith(TE_SCALE_UPDATE):  # all-reduces each state's amax history
        return f"{TE_SCALE_UPDATE}({len(bsym.kwargs.get('states', ()))} states)"
    if name not in COLLECTIVES and name not in PASS_COLLECTIVES:
        return None
    flat, _ = tree_flatten((bsym.args, bsym.kwargs))
    if name == "fp8shard_shard":  # its spec says whether it runs any (a slice of this rank's copy does not)
        text = next((x.collective_text() for x in flat if hasattr(x, "collective_text")), "")
        return f"{name}({text})" if text else None
    return f"{name}({', '.join(_arg(x) for x in flat)})"


def signature(fw: TraceCtx, bw: TraceCtx) -> tuple[str, ...]:
    """The collectives the program ``fw`` + ``bw`` issues, in order."""
    return tuple(d for t in (fw, bw) for b in t.bound_symbols if (d := describe(b)) is not None)


def first_difference(mine: tuple[str, ...], agreed: tuple[str, ...]) -> str:
    """Where two signatures part, in words."""
    i = next((i for i, (a, b) in enumerate(zip(mine, agreed)) if a != b), min(len(mine), len(agreed)))
    return (f"collective {i}: this program's '{mine[i] if i < len(mine) else '(none)'}', the agreed "
            f"'{agreed[i] if i < len(agreed) else '(none)'}'")


@dataclass
class Layouts:
    """A transform's agreed layouts by program key; ``open`` while the ranks compile together."""

    open: bool = True
    by_program: dict[str, Layout] = field(default_factory=dict)
