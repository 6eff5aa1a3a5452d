"""Which outputs of a fusion region share a storage with one of its inputs, or with each other.

torch.compile keeps eager aliasing, so a ``TorchCompile<n>`` region's outputs need not be new storages: in LitGPT's
attention the region returns ``v`` as a view of ``qkv``, and a saved ``v`` keeps all of ``qkv`` alive.
:func:`region_aliasing` replays each region structure once on fake tensors (no memory, no device work) and reads the
storages that come back. A failed replay warns (raises under ``THUNDER_FP8SHARD_STRICT_REPLAY``) and counts the outputs
as new; inputs are taken contiguous, and the run-time audit reports any difference. Other fusion executors' outputs
count as new storages."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from thunder.core.proxies import NumberProxy, Proxy, TensorProxy
from thunder.core.symbol import BoundSymbol

log = logging.getLogger(__name__)

TORCH_COMPILE_REGION = "TorchCompile"  # the fusion symbols' name prefix in thunder/executors/torch_compile.py
# set (not "0"): a failed replay raises instead of warning
STRICT_ENV = "THUNDER_FP8SHARD_STRICT_REPLAY"


@dataclass(frozen=True)
class RegionAliasing:
    """The storages of a region's outputs: ``views_of``, output -> the input it views; ``shared``, ``(outputs, bytes)``
    of each buffer the region allocates that backs several outputs or one smaller than itself."""

    views_of: dict[str, str]
    shared: tuple[tuple[tuple[str, ...], int], ...]


NO_ALIASING = RegionAliasing({}, ())


def is_torch_compile_region(bsym: BoundSymbol) -> bool:
    return bool(bsym.sym.is_fusion) and bsym.sym.name.startswith(TORCH_COMPILE_REGION)


def region_aliasing(bsym: BoundSymbol) -> RegionAliasing:
    """:class:`RegionAliasing` of ``bsym``'s outputs (``NO_ALIASING`` if it is not a torch.compile region or the replay
    fails)."""
    if not is_torch_compile_region(bsym):
        return NO_ALIASING
    ins = _unique_args(bsym)
    outs = [o for o in bsym.flat_outs if isinstance(o, TensorProxy)]
    try:
        views, shared = _replayed(_structure(bsym), bsym)
    except Exception as e:  # noqa: BLE001 (counted as new storages)
        if os.environ.get(STRICT_ENV, "") not in ("", "0"):
            raise RuntimeError(f"could not replay {bsym.sym.name} on fake tensors ({STRICT_ENV} is set)") from e
        log.warning("ShardIntermediates: could not replay %s on fake tensors (%s: %s); its outputs count as new "
                    "storages", bsym.sym.name, type(e).__name__, e)
        return NO_ALIASING
    return RegionAliasing(
        {outs[o].name: ins[i].name for o, i in views},
        tuple((tuple(outs[o].name for o in group), nbytes) for group, nbytes in shared),
    )


def _unique_args(bsym: BoundSymbol) -> list:
    """The region's arguments, each proxy once in order of first appearance: a region may take one tensor at several
    positions, which a function cannot take as parameters of one name."""
    seen, out = set(), []
    for a in bsym.args:
        if isinstance(a, Proxy):
            if a.name in seen:
                continue
            seen.add(a.name)
        out.append(a)
    return out


def _structure(bsym: BoundSymbol) -> tuple:
    """A key shared by regions of one structure: input shapes and dtypes, and each bound symbol's name, arguments and
    outputs (proxies by order of first appearance)."""
    index: dict[str, int] = {}

    def canon(x):
        if isinstance(x, TensorProxy):
            return ("t", index.setdefault(x.name, len(index)), tuple(x.shape), str(x.dtype))
        if isinstance(x, Proxy):
            return ("p", index.setdefault(x.name, len(index)), repr(getattr(x, "value", None)))
        return ("c", repr(x))

    head = tuple(canon(a) for a in bsym.args)
    body = tuple((b.sym.name, tuple(canon(a) for a in b.flat_args), tuple(canon(o) for o in b.flat_outs))
                 for b in bsym.subsymbols)
    return head, body, tuple(canon(o) for o in bsym.flat_outs)


_cache: dict[tuple, tuple] = {}


def _replayed(key: tuple, bsym: BoundSymbol) -> tuple:
    """``(views: ((output, input index), ...), shared: ((output indices, buffer bytes), ...))``, cached by structure."""
    if key not in _cache:
        _cache[key] = _replay(bsym)
    return _cache[key]


def _replay(bsym: BoundSymbol) -> tuple:
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef

    from torch._subclasses.fake_tensor import FakeTensorMode

    fn = _region_function(bsym)
    # on the inputs' own devices, so a region that names a device meets tensors there
    with FakeTensorMode(), torch.no_grad():
        inputs = [_fake(a) for a in _unique_args(bsym)]
        results = fn(*inputs)
    outs = [o for o in bsym.flat_outs if isinstance(o, TensorProxy)]
    returned = results if isinstance(results, (tuple, list)) else (results,)
    tensors = [r for r in returned if isinstance(r, torch.Tensor)]
    if len(tensors) != len(outs):
        raise ValueError(f"{len(tensors)} tensors came back for {len(outs)} tensor outputs")
    storage_of_input = {StorageWeakRef(t.untyped_storage()): i for i, t in enumerate(inputs)
                        if isinstance(t, torch.Tensor)}
    views, allocated = [], {}
    for k, t in enumerate(tensors):
        s = StorageWeakRef(t.untyped_storage())
        if s in storage_of_input:
            views.append((k, storage_of_input[s]))
        else:
            allocated.setdefault(s, (t.untyped_storage().nbytes(), []))[1].append(k)
    shared = tuple((tuple(ks), int(nbytes)) for nbytes, ks in allocated.values()
                   if len(ks) > 1 or nbytes > tensors[ks[0]].numel() * tensors[ks[0]].element_size())
    return tuple(views), shared


def _fake(p):
    """A tensor like ``p`` under the caller's FakeTensorMode, else ``p``'s value."""
    import torch
    from thunder.core.devices import to_torch_device
    from thunder.core.dtypes import to_torch_dtype

    if isinstance(p, TensorProxy):
        return torch.empty(tuple(int(s) for s in p.shape), dtype=to_torch_dtype(p.dtype), device=to_torch_device(p.device))
    if isinstance(p, NumberProxy):
        return p.value
    if isinstance(p, Proxy):
        raise TypeError(f"an input of type {type(p).__name__}")
    return p


def _region_function(bsym: BoundSymbol):
    """The region's function as ``make_compiled`` gives it to torch.compile."""
    from thunder.core import prims
    from thunder.core.codeutils import SigInfo
    from thunder.core.trace import TraceCtx, tracectx
    from thunder.executors.passes import transform_for_execution
    from thunder.executors.torchex import ex as pytorch_ex

    trace = TraceCtx(None)
    trace.args, trace.kwargs = _unique_args(bsym), {}
    trace.names = {a.name for a in trace.args if isinstance(a, Proxy)}
    with tracectx(trace):
        for a in trace.args:
            prims.unpack_trivial(a, name=a.name)
    trace.bound_symbols += list(bsym.subsymbols)
    trace.bound_symbols.append(prims.python_return.bind(list(bsym.output), output=None))
    for b in trace.bound_symbols:
        for o in (*b.flat_outs, *(o for s in b.subsymbols for o in s.flat_outs)):
            if isinstance(o, Proxy) and o.name not in trace.names:
                trace.add_name(o.name)
    trace._siginfo = SigInfo("fp8shard_region_replay")
    trace._siginfo.args = [(a.name, None) for a in trace.args]
    return transform_for_execution(trace, executors_list=(pytorch_ex,)).python_callable(include_decorators=False)
