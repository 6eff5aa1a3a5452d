"""Names that survive a recompilation. Ranks compile their own programs and proxy names are counters, so the agreed
layout names tensors by how they are computed: a hash of the operator, its constants and its arguments' keys down to the
forward's inputs, with per-rank arguments as a placeholder."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

import torch
import torch.distributed as dist
from thunder.core import devices, dtypes
from thunder.core.proxies import Proxy, TensorProxy
from thunder.core.pytree import tree_flatten
from thunder.core.trace import TraceCtx

from thunder_fp8shard.analysis.liveness import is_compute
from thunder_fp8shard.analysis.names import COLLECTIVES
from thunder_fp8shard.analysis.saved import forward_inputs

PER_RANK = "*"  # what an argument outside ``stable`` contributes to a key
_COUNTER = re.compile(r"_\d+$")  # stateful operators are numbered per compilation (get_te_fp8_state_3)


def _constant(x) -> str:
    """A constant argument as the same text on every rank and in every compilation."""
    if x is None or isinstance(x, (bool, int, float, str, slice, type(Ellipsis), torch.dtype, dtypes.dtype)):
        return repr(x)
    if isinstance(x, (tuple, list)):
        return "(" + ",".join(_constant(v) for v in x) + ")"
    if isinstance(x, (torch.device, devices.Device)):
        return f"device:{x.type}"
    if isinstance(x, dist.ProcessGroup):  # by size: subgroups of a partition are peers
        return f"group:{x.size()}"
    return f"<{type(x).__name__}>"


def tensor_keys(trace: TraceCtx, stable: Iterable[str]) -> dict[str, str]:
    """The structural key of every proxy in ``stable`` (the same in every compilation); a repeated key gets its
    occurrence number."""
    stable = set(stable)
    keys: dict[str, str] = {p.name: f"in:{p.name}" for p in forward_inputs(trace) if p.name in stable}
    seen: dict[str, int] = {}

    for b in trace.bound_symbols:
        if not is_compute(b):
            continue
        flat_args, _ = tree_flatten((b.args, b.kwargs))
        args = (keys.get(x.name, PER_RANK) if isinstance(x, Proxy) else _constant(x) for x in flat_args)
        op = _COUNTER.sub("", b.sym.name) + "(" + ",".join(args) + ")"
        for i, out in enumerate(b.flat_proxy_outs):
            if out.name not in stable or out.name in keys:
                continue
            digest = hashlib.sha256(f"{op}[{i}]".encode()).hexdigest()[:24]
            n = seen.get(digest, 0)
            seen[digest] = n + 1
            keys[out.name] = digest if n == 0 else f"{digest}#{n}"
    return keys


def program_key(trace: TraceCtx, parameters: Iterable[str], backward: TraceCtx | None = None) -> str:
    """What identifies a program across recompilations: its forward's tensor input names, with the shapes and dtypes of
    ``parameters`` (ThunderFX layers of one class share names), and the kinds of collective its ``backward`` issues, in
    order (Thunder DDP's backward under ``skip_data_parallel_grad_sync()`` reduces no gradient: another program of
    the same forward; names only, so that every rank's input shapes give one key)."""
    parameters = set(parameters)
    names = sorted(p.name + (f":{p.dtype}{list(p.shape)}" if p.name in parameters else "")
                   for p in forward_inputs(trace) if isinstance(p, TensorProxy))
    kinds = [] if backward is None else [b.sym.name for b in backward.bound_symbols if b.sym.name in COLLECTIVES]
    return hashlib.sha256(",".join(names + ["|", *kinds]).encode()).hexdigest()[:24]
