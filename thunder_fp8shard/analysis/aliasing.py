"""Which outputs of a fusion region share a storage with one of its inputs, or with each other.

A bound symbol of Thunder's torch-level view ops (``reshape``, ``transpose``, ``split``, ...) returns a view of its
input, and :mod:`thunder_fp8shard.analysis.liveness` knows those by name. A *fusion region* is one bound symbol whose
outputs look new, but need not be: Thunder's torch.compile executors (``torch_compile_cat_ex``, which Thunder's own
``benchmark_litgpt.py`` puts first with ``--compile=thunder_inductor_cat``, ``torch_compile_ex``,
``torch_compile_xentropy_ex``: every ``TorchCompile<n>`` region) hand the region's function to ``torch.compile``,
which keeps eager aliasing: an output that is a view of an input comes back as a view of that input, and outputs
that are views of one buffer the region allocates come back sharing that buffer, whole (AOTAutograd regenerates
such outputs from their base). LitGPT's attention is the case that matters: the qkv split, views and transposes land
in one region with the RoPE and its ``cat``, and the region returns ``v`` as a view of its input ``qkv``, so a saved
``v`` (a third of ``qkv``) keeps all of ``qkv`` alive until its backward.

:func:`region_aliasing` finds this out by running the region's function as torch.compile is given it (the region's
bound symbols through Thunder's torch executor, as ``thunder.executors.torch_compile.make_compiled`` builds it) once,
eagerly, on fake tensors (``FakeTensorMode``) on the inputs' own devices: no memory and no device work, a region that
names a device (``.to(torch.device("cuda:0"))``, a tensor made there) meets tensors on it as when it runs, and the
storages that come back say which outputs alias what. A region the replay cannot run logs a warning and its outputs
count as new storages; with ``THUNDER_FP8SHARD_STRICT_REPLAY=1`` (the tests) it raises. Regions of
the same structure (every layer of a model) are replayed once. The inputs are taken contiguous (their real strides
are not in the trace): a region that copies or views depending on its inputs' strides could differ; the pass
measures the saved storages at the first call and reports any difference (:mod:`thunder_fp8shard.runtime.audit`).

Other fusion executors are left alone (their outputs count as new storages): nvFuser moves the view ops at a
fusion's edges out of it ("bookends", then top-level views the model sees) and was not available to check here.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from thunder.core.proxies import NumberProxy, Proxy, TensorProxy
from thunder.core.symbol import BoundSymbol

log = logging.getLogger(__name__)

TORCH_COMPILE_REGION = "TorchCompile"  # the fusion symbols' name prefix of thunder/executors/torch_compile.py
# set (not "0"): a region the replay cannot run raises instead of a warning (the tests set it: tests/conftest.py)
STRICT_ENV = "THUNDER_FP8SHARD_STRICT_REPLAY"


@dataclass(frozen=True)
class RegionAliasing:
    """The storages of a fusion region's outputs, by output name: ``views_of`` maps an output that is a view of a
    region input to that input's name; ``shared`` lists the buffers the region allocates that back more than one
    output, or an output smaller than the buffer: ``(output names, the buffer's bytes)``. Outputs in neither are
    new storages of their own size."""

    views_of: dict[str, str]
    shared: tuple[tuple[tuple[str, ...], int], ...]


NO_ALIASING = RegionAliasing({}, ())


def is_torch_compile_region(bsym: BoundSymbol) -> bool:
    return bool(bsym.sym.is_fusion) and bsym.sym.name.startswith(TORCH_COMPILE_REGION)


def region_aliasing(bsym: BoundSymbol) -> RegionAliasing:
    """What :class:`RegionAliasing` says of ``bsym``'s outputs (``NO_ALIASING`` for bound symbols that are not
    torch.compile regions, and where the replay fails: logged, and the outputs then count as new storages)."""
    if not is_torch_compile_region(bsym):
        return NO_ALIASING
    ins = _unique_args(bsym)
    outs = [o for o in bsym.flat_outs if isinstance(o, TensorProxy)]
    try:
        key = _structure(bsym)
        by_position = _replayed(key, bsym)
    except Exception as e:  # noqa: BLE001  (a region the replay cannot run: counted as new storages, as before)
        if os.environ.get(STRICT_ENV, "") not in ("", "0"):
            raise RuntimeError(f"could not replay {bsym.sym.name} on fake tensors ({STRICT_ENV} is set)") from e
        log.warning("ShardIntermediates: could not replay %s on fake tensors (%s: %s); its outputs count as new "
                    "storages", bsym.sym.name, type(e).__name__, e)
        return NO_ALIASING
    views, shared = by_position
    return RegionAliasing(
        {outs[o].name: ins[i].name for o, i in views},
        tuple((tuple(outs[o].name for o in group), nbytes) for group, nbytes in shared),
    )


def _unique_args(bsym: BoundSymbol) -> list:
    """The region's arguments, each proxy once (in order of first appearance): a region may take one tensor at
    several positions (LitGPT's RoPE region takes ``cos`` and ``sin`` once for ``q`` and once for ``k`` under
    Thunder FSDP), which a function of its own cannot take as parameters of one name."""
    seen, out = set(), []
    for a in bsym.args:
        if isinstance(a, Proxy):
            if a.name in seen:
                continue
            seen.add(a.name)
        out.append(a)
    return out


def _structure(bsym: BoundSymbol) -> tuple:
    """A key that regions of the same structure share: their inputs' shapes and dtypes, and each bound symbol's name,
    its arguments (proxies by order of first appearance, other values as printed) and its outputs."""
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
    """``(views: ((output index, input index), ...), shared: ((output indices, buffer bytes), ...))``, cached by
    structure."""
    if key not in _cache:
        _cache[key] = _replay(bsym)
    return _cache[key]


def _replay(bsym: BoundSymbol) -> tuple:
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef

    from torch._subclasses.fake_tensor import FakeTensorMode

    fn = _region_function(bsym)
    # fake tensors on the inputs' own devices: a region whose bound symbols name a device (a tensor made on
    # cuda:0, a .to(device)) meets tensors on that device, as it does when it runs
    with FakeTensorMode(), torch.no_grad():
        inputs = [_fake(a) for a in _unique_args(bsym)]
        results = fn(*inputs)
    results = [r for r in (results if isinstance(results, (tuple, list)) else (results,))]
    outs = [o for o in bsym.flat_outs if isinstance(o, TensorProxy)]
    tensors = [r for r in results if isinstance(r, torch.Tensor)]
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
    shared = []
    for nbytes, ks in allocated.values():
        own = tensors[ks[0]].numel() * tensors[ks[0]].element_size()
        if len(ks) > 1 or nbytes > own:
            shared.append((tuple(ks), int(nbytes)))
    return tuple(views), tuple(shared)


def _fake(p):
    """A tensor like ``p`` under the FakeTensorMode the caller entered (no memory, ``p``'s device), else ``p``'s
    value."""
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
    """The region's function as ``make_compiled`` gives it to torch.compile: its bound symbols through the torch
    executor, its inputs as arguments, its outputs returned."""
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
