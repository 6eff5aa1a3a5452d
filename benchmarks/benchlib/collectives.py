"""Simulated collectives that launch what NCCL launches (``paired.py --sim-collectives one-kernel``, the default).

Torch's fake process group renders an all-gather into a tensor as N ``copy_`` calls and an all-reduce or a
reduce-scatter as nothing. :func:`install` patches the ``torch.distributed.ProcessGroup`` methods of :data:`RENDER`
(what torch.distributed's Python API calls, and the pass's direct ``_allgather_base``): on a group whose backend is
``"fake"`` each writes its output with one kernel on the current stream (an all-gather a vectorized copy: one
``cat`` of N times its input, and a coalesced one a single ``cat`` where its outputs lie in order in one buffer; a
pair of tensors for the other list and coalesced forms) and returns a completed :class:`Done`; another backend gets the original. Values are as
meaningless as the fake group's, but bounded: an all-gather's chunks are all this rank's input, a reduce-scatter
copies this rank's own chunk (a real one also reads the other N-1), an all-reduce or broadcast rewrites the tensor
with its own values (``mul_`` by a CPU scalar 1). Not covered: ``allgather`` into a list (the fake group's N copies;
NCCL also copies out N times) and collectives issued from C++ (functional collectives: FSDP2/DTensor, torch.compile).
``calls`` counts the calls by method (``"delegated"``: another backend's).
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

MODES = ("one-kernel", "fake-group")
calls: Counter = Counter()
_groups: dict = {}  # group -> (size, rank) if its backend is the fake one, else None
_originals: dict = {}
_ONES: dict = {}


class Done(dist.Work):
    """A collective already done, for the callers of a work object."""

    def __init__(self, result: list):
        super().__init__()
        self._result = result

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def result(self) -> list:
        return self._result

    def synchronize(self) -> None:
        pass

    def block_current_stream(self) -> None:
        pass

    def get_future(self) -> torch.futures.Future:
        f = torch.futures.Future()
        f.set_result(self._result)
        return f


def _fake(group):
    got = _groups.get(group, False)
    if got is False:
        try:
            fake = dist.get_backend(group) == "fake"
        except (RuntimeError, ValueError):
            fake = False
        got = _groups[group] = (group.size(), group.rank()) if fake else None
    return got


def _gather(n, rank, out, inp):
    # one (vectorized) copy kernel writing the N chunks; a broadcast copy_ would write them byte by byte for uint8
    torch.cat([inp.reshape(-1)] * n, out=out.view(-1))


def _gathers(shape, outs, inps, *_):
    """A coalesced all-gather: one kernel for every pair (as NCCL's grouped launch) where the outputs lie in order
    in one buffer of the inputs' dtype (the pass's buckets; the alignment gaps between them are written with
    zeros), else one a pair."""
    n = shape[0]
    outs, inps = list(outs), list(inps)
    pieces = _adjacent(n, outs, inps)
    if pieces is None:
        return _pairs(_gather)(shape, outs, inps)
    parts = []
    for inp, gap in pieces:
        parts += [inp.reshape(-1)] * n
        if gap:
            parts.append(_zeros(gap, inp.dtype, inp.device))
    first = outs[0]
    torch.cat(parts, out=first.as_strided((sum(p.numel() for p in parts),), (1,)))
    return outs


def _adjacent(n, outs, inps):
    """``[(input, gap after its output in elements)]`` where the outputs are contiguous, of one dtype and in order
    in one storage, else None."""
    if len(outs) < 2 or any(o.dtype != outs[0].dtype or i.dtype != o.dtype or not o.is_contiguous()
                            or o.untyped_storage().data_ptr() != outs[0].untyped_storage().data_ptr()
                            for o, i in zip(outs, inps)):
        return None
    size = outs[0].element_size()
    pieces = []
    for k, (o, i) in enumerate(zip(outs, inps)):
        if o.numel() != n * i.numel():
            return None
        gap = 0
        if k + 1 < len(outs):
            gap = (outs[k + 1].data_ptr() - o.data_ptr()) // size - o.numel()
            if gap < 0:
                return None
        pieces.append((i, gap))
    return pieces


_ZEROS: dict = {}


def _zeros(n, dtype, device):
    z = _ZEROS.get((n, dtype, device))
    if z is None:
        z = _ZEROS[n, dtype, device] = torch.zeros(n, dtype=dtype, device=device)
    return z


def _scatter(n, rank, out, inp):
    out.copy_(inp.view(n, -1)[rank].view_as(out))


def _rewrite(t):
    t = t.view(torch.uint8) if t.element_size() == 1 else t  # bool, float8: no mul
    one = _ONES.get(t.dtype)
    if one is None:  # of the tensor's dtype, on the CPU: a kernel argument, no conversion of a Python 1
        one = _ONES[t.dtype] = torch.ones((), dtype=t.dtype)
    t.mul_(one)


def _listed(tensors):
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _base(render):
    def one(shape, out, inp, *_):
        render(*shape, out, inp)
        return [out]
    return one


def _pairs(render):
    def each(shape, outs, inps, *_):
        for out, inp in zip(outs, inps):
            render(*shape, out, inp)
        return list(outs)
    return each


def _in_place(shape, tensors, *_):
    tensors = _listed(tensors)
    for t in tensors:
        _rewrite(t)
    return tensors


RENDER = {"_allgather_base": _base(_gather), "_reduce_scatter_base": _base(_scatter), "allreduce": _in_place,
          "allreduce_coalesced": _in_place, "broadcast": _in_place,
          "allgather_into_tensor_coalesced": _gathers, "reduce_scatter_tensor_coalesced": _pairs(_scatter)}


def _patched(name: str, original, render):
    def method(self, *args, **kwargs):
        shape = _fake(self)
        if shape is None:
            calls["delegated"] += 1
            return original(self, *args, **kwargs)
        calls[name] += 1
        return Done(render(shape, *args))

    method.__name__ = method.__qualname__ = name
    return method


def install() -> None:
    """Every method of :data:`RENDER` patched on ``torch.distributed.ProcessGroup`` (once)."""
    pg = dist.ProcessGroup
    for name, render in RENDER.items():
        if name not in _originals:
            _originals[name] = getattr(pg, name)
            setattr(pg, name, _patched(name, _originals[name], render))


def uninstall() -> None:
    """The original methods back."""
    for name, original in _originals.items():
        setattr(dist.ProcessGroup, name, original)
    _originals.clear()
