"""Which proxies of a forward trace hold the same value on every rank of a process group. A value is *replicated* when
it is an all-gather over the group, or a known deterministic operation computes it from replicated inputs and constants
with a shape those inputs set. Everything else is *per-rank*, with the reason: the rank's inputs, random numbers,
non-deterministic or unknown operations, other groups' collectives, and shapes set by constants (ranks compile their own
shapes, so ``cos[:T]`` differs where ``T`` does)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from thunder.core.prims import PrimIDs
from thunder.core.proxies import DistParallelType, Proxy, TensorProxy
from thunder.core.pytree import tree_flatten
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx

from thunder_fp8shard.analysis.liveness import is_compute
from thunder_fp8shard.analysis.names import ALL_GATHER, SLICE, TE_LINEAR_FWD, TE_SCALE_UPDATE, WAIT
from thunder_fp8shard.analysis.saved import forward_inputs

# prims whose result is not a deterministic function of their inputs: what each is ({}: the symbol's name)
_NONDETERMINISTIC_PRIMS = {
    **dict.fromkeys((PrimIDs.UNIFORM, PrimIDs.UNIFORM_PHILOX, PrimIDs.RANDINT, PrimIDs.RANDN, PrimIDs.MULTINOMIAL,
                     PrimIDs.GET_AND_UPDATE_RNG_STATE), "random numbers ({})"),
    PrimIDs.EMPTY: "uninitialized memory ({})",
    **dict.fromkeys((PrimIDs.SCATTER_ADD, PrimIDs.INDEX_ADD, PrimIDs.INDEX_PUT, PrimIDs.EMBEDDING_BACKWARD),
                    "{}, which may accumulate in a different order on every run"),
    **dict.fromkeys((PrimIDs.EXOGENOUS_LIKE, PrimIDs.NUMPY_ARRAY_TO_TORCH_TENSOR, PrimIDs.SINK, PrimIDs.PRINT),
                    "{}, which the replication analysis does not model"),
}

# torchex: torch_slice_prim_impl, torch_prims_reshape_impl
_EXECUTOR_PRIM = re.compile(r"^torch_(?:prims_)?(\w+?)(?:_prim)?_impl$")
_OTHER_COLLECTIVES = ("torch_all_reduce", "torch_reduce_scatter", "torch_broadcast", "torch_pack", "torch_unpack")
SHAPED = "a shape the program's constants set"
# operators whose output shape the program's constants can set
_SHAPING_PRIMS = {PrimIDs.FULL, PrimIDs.IOTA, PrimIDs.TENSOR_FROM_SEQUENCE, PrimIDs.BROADCAST_IN_DIM, PrimIDs.SLICE,
                  PrimIDs.UNFOLD, PrimIDs.TAKE, PrimIDs.TAKE_ALONG_AXIS, PrimIDs.GATHER, PrimIDs.PAD, PrimIDs.TOPK}
_SHAPING_NAMES = {"split", "chunk", "tensor_split", "unbind", "getitem", "narrow", "select", "expand", "expand_as",
                  "broadcast_to", "repeat", "tile", "index_select", "gather", "take_along_dim", "full", "zeros",
                  "ones", "arange", "pad", "unfold", "as_strided", "diagonal", "topk"}


@dataclass(frozen=True)
class Replication:
    """The verdict for every proxy name of a trace: replicated, or per-rank with the reason why."""

    replicated: frozenset[str]
    per_rank: dict[str, str] = field(default_factory=dict)

    def is_replicated(self, name: str) -> bool:
        return name in self.replicated

    def reason(self, name: str) -> str:
        if name in self.replicated:
            return "identical on every rank (derived only from replicated roots and constants)"
        return self.per_rank.get(name, "not produced in the forward trace")


def analyze_replication(trace: TraceCtx, group, replicated_inputs: frozenset[str] = frozenset(),
                        input_reasons: Mapping[str, str] | None = None) -> Replication:
    """Classifies every proxy of ``trace``. The roots are the all-gathers over ``group`` and ``replicated_inputs``;
    other inputs are per-rank, for the reason ``input_reasons`` gives."""
    input_reasons = input_reasons or {}
    replicated: set[str] = set()
    per_rank: dict[str, str] = {}
    for arg in forward_inputs(trace):
        if arg.name in replicated_inputs:
            replicated.add(arg.name)
        else:
            per_rank[arg.name] = input_reasons.get(arg.name) or _input_reason(arg)

    def origin(p: Proxy) -> str | None:
        """None when ``p`` is replicated, else the reason it is not."""
        return None if p.name in replicated else per_rank.get(p.name, f"`{p.name}` comes from outside the trace")

    waited: set[str] = set()  # all-gathered parameters
    for bsym in trace.bound_symbols:
        if not is_compute(bsym):  # it makes no value
            continue
        if bsym.sym.name == WAIT:
            waited.update(p.name for p in bsym.flat_proxy_outs)
        for out, why in _verdicts(bsym, group, origin, waited):
            if why is None:
                replicated.add(out.name)
            else:
                per_rank.setdefault(out.name, why)
    return Replication(frozenset(replicated), per_rank)


def _verdicts(bsym: BoundSymbol, group, origin, waited: set[str]):
    """(output proxy, None or reason) for each output of ``bsym``."""
    outs = list(bsym.flat_proxy_outs)
    name = bsym.sym.name
    if name == ALL_GATHER:
        why = None if bsym.args[1] is group else "an all-gather over another process group"
        return [(o, why) for o in outs]
    if name == WAIT:
        return [(o, origin(bsym.args[0])) for o in outs]
    if name.startswith(TE_LINEAR_FWD):
        a, w, bias = bsym.args[:3]
        out, qa, qw = bsym.output
        return [(out, _first_origin([a, w, bias], origin)), (qa, _first_origin([a], origin)),
                (qw, _first_origin([w], origin))]
    if name.startswith(TE_SCALE_UPDATE):  # passes its tokens through, updating scales as a side effect
        tokens = bsym.kwargs.get("tokens", ())
        return [(o, origin(t)) for o, t in zip(bsym.output, tokens)]
    if (problem := _nondeterminism(bsym)) is not None:
        return [(o, problem) for o in outs]
    why = _first_origin(bsym.flat_proxy_args, origin)
    return [(o, why if why is not None else _shaped_by_constants(bsym, o, waited)) for o in outs]


def _shaped_by_constants(bsym: BoundSymbol, out, waited: set[str]) -> str | None:
    """None where ``out``'s shape follows from its tensor inputs' shapes (or it is 0-dim), else why it may differ
    between compilations. Thunder FSDP's unpad slice of a gathered parameter keeps the parameter's shape."""
    if not getattr(out, "shape", None):
        return None
    tensors = [p for p in bsym.flat_proxy_args if isinstance(p, TensorProxy)]
    if bsym.sym.name == SLICE and tensors and tensors[0].name in waited:
        return None
    shaping = bsym.sym.name if not tensors else _shaping(bsym)
    if shaping:
        return f"{SHAPED} (`{shaping}`): it may follow this rank's input shapes, and ranks compile their own shapes"
    return None


def _shaping(bsym: BoundSymbol) -> str | None:
    """The operator that can set an output shape from constants: ``bsym``, or one a fusion region runs (a composite's
    subsymbols take their shapes from its inputs)."""
    if _prim_id(bsym) in _SHAPING_PRIMS or bsym.sym.name.removeprefix("Tensor.") in _SHAPING_NAMES:
        return bsym.sym.name
    if bsym.sym.is_fusion:
        return next((sub.sym.name for sub in bsym.subsymbols
                     if _prim_id(sub) in _SHAPING_PRIMS or sub.sym.name in _SHAPING_NAMES), None)
    return None


def _nondeterminism(bsym: BoundSymbol) -> str | None:
    """None when ``bsym`` is a deterministic function of its inputs, else what it is."""
    if bsym.sym.name.startswith(_OTHER_COLLECTIVES):
        return f"{bsym.sym.name}, a collective the replication analysis does not model"
    prim = _prim_id(bsym)
    if prim is not None:
        return _NONDETERMINISTIC_PRIMS[prim].format(bsym.sym.name) if prim in _NONDETERMINISTIC_PRIMS else None
    if bsym.subsymbols:
        return next(filter(None, map(_nondeterminism, bsym.subsymbols)), None)
    return f"{bsym.sym.name}, which the replication analysis does not understand"


def _prim_id(bsym: BoundSymbol) -> PrimIDs | None:
    if bsym.sym.is_prim and isinstance(bsym.sym.id, PrimIDs):
        return bsym.sym.id
    # executors implement prims under the prim's name ("uniform") or as "torch_<prim>_prim_impl"
    m = _EXECUTOR_PRIM.match(bsym.sym.name)
    return PrimIDs.__members__.get((m.group(1) if m else bsym.sym.name).upper())


def _first_origin(proxies, origin) -> str | None:
    """Why the first per-rank argument is per-rank (None if all are replicated), preferring the rank's own data over a
    shape the constants set."""
    whys = [why for p in tree_flatten(proxies)[0] if isinstance(p, Proxy) and (why := origin(p)) is not None]
    if not whys:
        return None
    why = next((w for w in whys if SHAPED not in w), whys[0])
    return why if why.startswith("derived from") else f"derived from {why}"


def _input_reason(arg: Proxy) -> str:
    if getattr(arg, "distparallel_type", None) == DistParallelType.FULLY_SHARDED:
        return f"this rank's parameter shard `{arg.name}`"
    return f"the rank's input `{arg.name}`"
