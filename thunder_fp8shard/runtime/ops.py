"""Run-time operators the rewrite inserts: small Thunder operators (meta + Python implementation).

Forward, ``fp8shard_shard`` keeps this rank's shards of one or more buckets in one flat ``uint8`` tensor (gloo
refuses float8 collectives) plus a restorer per bucket; ``fp8shard_compact`` copies saved views compactly. Backward,
``fp8shard_gather_start`` starts a bucket's all-gather, ``fp8shard_gather_wait`` views the members out of the
buffer, and ``fp8shard_gather_next`` is both in one call. The operators run tens of times a CPU-bound step, so the
layouts are worked out on a shard op's first call and kept in its spec (:class:`_Program`). Operators inserted after
``transform_for_execution`` run through their bound symbols' call context, so the executor is never passed to
``thunder.jit``.
"""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from thunder.core import dtypes
from thunder.core.proxies import AnyProxy, TensorProxy
from thunder.core.symbol import default_python_printer
from thunder.extend import OperatorExecutor
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.distributed_c10d import AllgatherOptions

from thunder_fp8shard.distributed.agreement import TORCH_COLLECTIVES
from thunder_fp8shard.runtime import multicopy, payload
from thunder_fp8shard.planning.layout import BucketLayout, bucket_layout, packed_offsets, sources_layout

executor = OperatorExecutor("fp8shard")

_profiler = torch.autograd.profiler  # its _is_profiler_enabled is True while torch.profiler records
_UINT8 = torch.uint8
_PLAIN = payload.PLAIN
_KIND_OF_TYPE = payload.BY_TYPE


def _register(name: str, meta, fn, **kwargs):
    """``fn`` as the operator ``name``, under a profiler range of that name. ``fn`` is looked up at each call,
    so that a benchmark can replace it."""
    here, key = globals(), fn.__name__

    def profiled(*args):
        if _profiler._is_profiler_enabled:
            with torch.profiler.record_function(name):
                return here[key](*args)
        return here[key](*args)

    profiled.__name__ = profiled.__qualname__ = f"{name}_impl"
    return executor.register_operator(name, meta=meta, fn=profiled, **kwargs)


class ShardSpec:
    """One shard op's constants, baked into its bound symbol, and the :class:`_Program` it works out."""

    __slots__ = ("group", "k", "bucket_nbytes", "method", "verify", "names", "program", "copies")

    def __init__(self, group, k: int, bucket_nbytes: tuple[int, ...], method: str, verify: bool,
                 names: tuple[tuple[str, ...], ...]):
        self.group, self.k, self.bucket_nbytes = group, k, tuple(bucket_nbytes)
        self.method, self.verify, self.names = method, verify, names
        self.program: _Program | None = None
        self.copies = CompactCopies()

    @property
    def shard_nbytes(self) -> int:
        """Bytes of the op's output: its buckets' shards, packed."""
        return sum(self.bucket_nbytes)

    def __str__(self) -> str:
        return (f"{self.shard_nbytes:,} B a rank: 1/{self.k} of {len(self.bucket_nbytes)} bucket(s) "
                f"({self.method}{', verified' if self.verify else ''})")

    def collective_text(self) -> str:
        """The collectives the op runs, the same on every rank ("": slices of this rank's copies, none)."""
        parts = ([f"reduce_scatter {list(self.bucket_nbytes)}/{self.k}"] if self.method == "reduce_scatter" else []) + (
            [f"verify {sum(len(n) for n in self.names)}"] if self.verify else [])
        return ", ".join(parts)


class _Restore:
    """How one bucket's members come back from its gathered buffer: a typed view of the buffer per dtype,
    and per member its payload kind (None: plain) and ``(view index, shape, stride, offset)`` per buffer; ``plain``
    is the fast path where every member is a plain tensor."""

    __slots__ = ("typed", "members", "plain")

    def __init__(self, typed, members):
        self.typed, self.members = typed, members
        self.plain = tuple(s for _, (s,) in members) if all(kind is None for kind, _ in members) else None

    def __call__(self, buf: torch.Tensor, states: list) -> tuple:
        views = [buf] + [(buf if nbytes is None else buf[:nbytes]).view(dtype) for dtype, nbytes in self.typed]
        if self.plain is not None:
            return tuple([views[i].as_strided(shape, stride, offset) for i, shape, stride, offset in self.plain])
        out = []
        for (kind, segments), state in zip(self.members, states):
            parts = [views[i].as_strided(shape, stride, offset) for i, shape, stride, offset in segments]
            out.append(parts[0] if kind is None else kind.give(state, parts))
        return tuple(out)


class Restorer:
    """What rebuilds a bucket's members besides the gathered bytes. Used once: the wait takes the states out,
    so nothing here keeps the gathered buffer alive (Thunder's autograd context holds saved non-tensors until the
    whole backward is done)."""

    __slots__ = ("_restore", "_states")

    def __init__(self, restore: _Restore | None, states: list | None):
        self._restore, self._states = restore, states

    @property
    def taken(self) -> bool:
        """Whether the members were restored."""
        return self._states is None

    def restore(self, buf: torch.Tensor) -> tuple:
        states, self._states = self._states, None
        if states is None:
            raise RuntimeError("ShardIntermediates: a sharded bucket was restored twice (backward run twice?)")
        return self._restore(buf, states)


class SourceRestorer:
    """The restorer of a bucket whose shards are forward inputs, gathered by one coalesced all-gather. It has no
    state, so one object serves every step as a constant of the backward trace."""

    __slots__ = ("_restore", "offsets", "nbytes", "_n")

    def __init__(self, restore: _Restore, offsets: tuple[int, ...], nbytes: int):
        self._restore, self.offsets, self.nbytes, self._n = restore, offsets, nbytes, len(offsets)

    @classmethod
    def of(cls, members, k: int) -> SourceRestorer:
        """The restorer of ``members`` (plain tensor proxies), each all-gathered over ``k`` ranks."""
        likes = [torch.empty(tuple(m.shape), dtype=dtypes.to_torch_dtype(m.dtype), device="meta") for m in members]
        lay = sources_layout([t.nbytes for t in likes])
        return cls(_bucket_restore(lay, [_PLAIN] * len(likes), [1] * len(likes), likes), lay.offsets, lay.nbytes)

    def restore(self, buf: torch.Tensor) -> tuple:
        return self._restore(buf, [None] * self._n)

    def __repr__(self) -> str:  # printed in the trace
        return "SourceRestorer()"


class _Program:
    """What a shard op works out from its payloads' buffers, valid while their kinds, counts, shapes and
    dtypes stay the same: this rank's ``pieces`` of the shard, the buckets' ``layouts`` and ``restores``, and on a
    CUDA device its one-launch copies (``launch``, worked out on the first call)."""

    __slots__ = ("kinds", "counts", "shapes", "dtypes", "pieces", "tiled", "dtype", "layouts", "offsets", "restores",
                 "launch")


def _program(spec: ShardSpec, buckets, kinds: list, counts: list[int], buffers: list[torch.Tensor]) -> _Program:
    rank = dist.get_rank(spec.group)
    prog = _Program()
    prog.kinds, prog.counts = kinds, counts
    prog.shapes, prog.dtypes = [b.shape for b in buffers], [b.dtype for b in buffers]
    layouts, first_buffer, restores = [], [], []
    m = k = 0
    for objs in buckets:
        n = sum(counts[m : m + len(objs)])
        lay = bucket_layout([b.nbytes for b in buffers[k : k + n]], spec.k)
        layouts.append(lay)
        first_buffer.append(k)
        restores.append(_bucket_restore(lay, kinds[m : m + len(objs)], counts[m : m + len(objs)], buffers[k : k + n]))
        m, k = m + len(objs), k + n
    sizes = tuple(lay.shard_nbytes for lay in layouts)
    if sizes != spec.bucket_nbytes:
        by_bucket = f" (by bucket {list(sizes)} against {list(spec.bucket_nbytes)})" if len(sizes) > 1 else ""
        raise RuntimeError(f"ShardIntermediates: the shard op's payload is {sum(sizes):,} B a rank, the plan "
                           f"said {spec.shard_nbytes:,} B{by_bucket} (did a saved tensor change shape or dtype?)")
    prog.layouts, (prog.offsets, total) = tuple(layouts), packed_offsets(sizes)
    pieces, tiled = [], 0  # (buffer index, first byte, bytes, offset in the shard)
    for lay, k0, at in zip(layouts, first_buffer, prog.offsets):
        for seg, start, stop, off in lay.pieces(rank):
            pieces.append((k0 + seg, start, stop - start, at + off))
            tiled = tiled + stop - start if at + off == tiled else -1
    prog.tiled = bool(pieces) and tiled == total
    read = {prog.dtypes[k] for k, *_ in pieces}
    prog.dtype = read.pop() if len(read) == 1 and buffers[pieces[0][0]].element_size() == 1 else _UINT8
    prog.pieces = tuple((k, start, n, prog.dtypes[k] is not prog.dtype, at) for k, start, n, at in pieces)
    prog.restores = tuple(restores)
    prog.launch = _UNSET
    return prog


def _bucket_restore(lay: BucketLayout, kinds: list, counts: list[int], buffers: list[torch.Tensor]) -> _Restore:
    typed: list[tuple[torch.dtype, int | None]] = []
    index = {_UINT8: 0}
    segments = []
    for b, offset in zip(buffers, lay.offsets):
        size = b.element_size()
        if b.dtype not in index:
            index[b.dtype] = len(typed) + 1
            whole = lay.gathered_nbytes - lay.gathered_nbytes % size
            typed.append((b.dtype, None if whole == lay.gathered_nbytes else whole))
        # offsets are multiples of ALIGN, hence of any element size
        segments.append((index[b.dtype], tuple(b.shape), make_contiguous_strides_for(b.shape), offset // size))
    members, k = [], 0
    for kind, n in zip(kinds, counts):
        members.append((None if kind is _PLAIN else kind, tuple(segments[k : k + n])))
        k += n
    return _Restore(tuple(typed), tuple(members))


# ---- forward: keep 1/k of replicated payloads ----


def _shard_meta(buckets, spec: ShardSpec, views=()):
    shard = TensorProxy(like=buckets[0][0], shape=(spec.shard_nbytes,), dtype=dtypes.uint8, requires_grad=False)
    restorers = (AnyProxy(Restorer(None, None), prefix="restore") for _ in buckets)
    return (shard, *restorers, *_compact_meta(views, spec.copies))


def _shard(buckets, spec: ShardSpec, views=()):
    buffers, kinds, counts, states = [], [], [], []
    for objs in buckets:
        bucket_states = []
        for obj in objs:
            kind = _KIND_OF_TYPE.get(type(obj)) or payload.kind_of(obj)
            member_buffers, state = ([obj], None) if kind is _PLAIN else kind.take(obj)
            buffers += member_buffers
            bucket_states.append(state)
            counts.append(len(member_buffers))
            kinds.append(kind)
        states.append(bucket_states)
    prog = spec.program
    if (prog is None or kinds != prog.kinds or counts != prog.counts or [b.shape for b in buffers] != prog.shapes
            or [b.dtype for b in buffers] != prog.dtypes):
        prog = spec.program = _program(spec, buckets, kinds, counts, buffers)
    if spec.verify:
        _verify(spec, counts, buffers)
    if spec.method == "reduce_scatter":
        shard, made = _reduce_scatter(spec, prog, buffers), spec.copies(views) if views else ()
    else:
        shard, made = _slice_and_compact(spec, prog, buffers, views)
    return (shard, *[Restorer(r, s) for r, s in zip(prog.restores, states)], *made)


_UNSET = object()  # a program's launch before its first call


class _Launch:
    """A program's copies in one kernel launch (:mod:`~thunder_fp8shard.runtime.multicopy`): this rank's pieces
    (``sources``: buffer and first byte, ``targets``: offset in the shard), then the items of the compaction views
    as their call site's :class:`CompactCopies` saw them (``strides``)."""

    __slots__ = ("copies", "strides", "sources", "targets")


def _launch(prog: _Program, buffers: list[torch.Tensor], views, compact: CompactCopies) -> _Launch | None:
    """The one-launch copies of ``prog`` and ``compact``'s views (None: not all on one device with the kernel)."""
    launch = _Launch()
    launch.strides = compact.strides
    launch.sources = tuple((k, start) for k, start, *_ in prog.pieces)
    launch.targets = tuple(at for *_, at in prog.pieces)
    items = [multicopy.Item(n) for _, _, n, _, _ in prog.pieces] + [i for i in compact.items or () if i is not None]
    launch.copies = _copies_on((*buffers, *views), items)
    return launch if launch.copies is not None else None


def _copies_on(tensors, items: list) -> multicopy.Copies | None:
    """One launch copying ``items`` on the CUDA device of all ``tensors`` (None: another device, or several, or no
    kernel there)."""
    on = {t.device for t in tensors}
    device = on.pop() if len(on) == 1 else None
    return multicopy.Copies.on(items, device) if device is not None and device.type == "cuda" else None


def _slice_and_compact(spec: ShardSpec, prog: _Program, buffers: list[torch.Tensor], views) -> tuple:
    """This rank's bytes of the buckets, a fresh allocation (so the full buffers are freed once the forward drops
    them), and a compact copy of each view: one kernel launch on a CUDA device, else torch's copies."""
    compact = spec.copies
    if views:
        compact.update(views)
    launch = prog.launch
    if launch is _UNSET or (launch is not None and launch.strides is not compact.strides):
        launch = prog.launch = _launch(prog, buffers, views, compact)
    if launch is None or not all(buffers[k].is_contiguous() for k, _ in launch.sources):
        return _slice(spec, prog, buffers), compact(views) if views else ()
    shard = torch.empty(spec.shard_nbytes, dtype=_UINT8, device=(buffers or views)[0].device)
    base = shard.data_ptr()
    sources = [buffers[k].data_ptr() + start for k, start in launch.sources]
    targets = [base + at for at in launch.targets]
    out = compact.empties(views, sources, targets) if views else []
    launch.copies(sources, targets)
    return shard, out


def _slice(spec: ShardSpec, prog: _Program, buffers: list[torch.Tensor]) -> torch.Tensor:
    """This rank's bytes of the buckets with torch (the CPU): one copy kernel when the pieces tile the shard."""
    pieces = []
    for k, start, n, retype, _ in prog.pieces:
        b = buffers[k].contiguous()
        if retype:
            b = (b.view(-1) if b.dim() == 0 else b).view(_UINT8)  # a 0-dim scale has no dim to retype
        pieces.append(b.as_strided((n,), (1,), b.storage_offset() + start))
    if prog.tiled:
        shard = pieces[0].clone() if len(pieces) == 1 else torch.cat(pieces)
    else:
        shard = torch.empty(spec.shard_nbytes, dtype=prog.dtype, device=buffers[0].device)
        for src, (*_, at) in zip(pieces, prog.pieces):
            shard[at : at + src.numel()].copy_(src)
    return shard if prog.dtype is _UINT8 else shard.view(_UINT8)


def _reduce_scatter(spec: ShardSpec, prog: _Program, buffers: list[torch.Tensor]) -> torch.Tensor:
    device = buffers[0].device
    shard = torch.empty(spec.shard_nbytes, dtype=_UINT8, device=device)
    k = 0
    for lay, at in zip(prog.layouts, prog.offsets):
        full = torch.zeros(lay.gathered_nbytes, dtype=_UINT8, device=device)
        for b, off, size in zip(buffers[k : k + len(lay.sizes)], lay.offsets, lay.sizes):
            full[off : off + size].copy_(payload.as_bytes(b))
        k += len(lay.sizes)
        # identical replicas: MAX of equal bytes is those bytes
        dist.reduce_scatter_tensor(shard[at : at + lay.shard_nbytes], full, op=dist.ReduceOp.MAX, group=spec.group)
    return shard


def _verify(spec: ShardSpec, counts: list[int], buffers: list[torch.Tensor]) -> None:
    """Raises on every rank if the ranks' payloads differ (compares SHA-256 digests of each member's bytes)."""
    k = 0
    for name, n in zip((name for names in spec.names for name in names), counts):
        h = hashlib.sha256()
        for b in buffers[k : k + n]:
            h.update(payload.as_bytes(b).detach().cpu().numpy().tobytes())
        k += n
        digests = TORCH_COLLECTIVES.all_gather_digests(h.digest(), spec.group)
        differing = [r for r, d in enumerate(digests) if d != digests[0]]
        if differing:
            raise RuntimeError(
                f"ShardIntermediates(verify=True): saved tensor {name!r} is not identical on every rank "
                f"(ranks {differing} differ from rank 0), so it cannot be rebuilt from shards. The replication "
                "analysis accepted a per-rank tensor: please report this with the forward trace."
            )


def _shard_printer(bsym, out_printables, arg_printables, kwarg_printables) -> str:
    """The default line, and what the spec (printed as a name) holds."""
    line = default_python_printer(bsym, out_printables, arg_printables, kwarg_printables)
    return f"{line}  # {bsym.args[1]}"


shard = _register("fp8shard_shard", _shard_meta, _shard, python_printer=_shard_printer)


# ---- backward: all-gather the shards and rebuild ----


_ASYNC = AllgatherOptions()
_ASYNC.asyncOp = True


class GatherHandle(NamedTuple):
    """An all-gather in flight: its work handle and the buffer it fills."""

    work: Any
    buffer: torch.Tensor


def _gather_start_meta(shard, offset: int, nbytes: int, k: int, group):
    return AnyProxy(GatherHandle(None, None), prefix="gather")


def _gather_start(shard, offset, nbytes: int, k: int, group) -> GatherHandle:
    if type(shard) is tuple:  # a bucket's sources (forward inputs)
        return _gather_sources(shard, offset, nbytes, k, group)
    mine = shard if nbytes == shard.numel() else shard[offset : offset + nbytes]
    out = shard.new_empty(nbytes * k)
    # dist.all_gather_into_tensor without its argument checks, which our plain uint8 tensors never need
    return GatherHandle(group._allgather_base(out, mine, _ASYNC), out)


def _gather_sources(sources: tuple, offsets: tuple[int, ...], nbytes: int, k: int, group) -> GatherHandle:
    """One coalesced all-gather of a bucket's inputs into one buffer. Under gloo, one all-gather each: its
    coalesced form allocates buffers of its own, larger than the memory model's scratch."""
    ins = [s.detach().reshape(-1).view(_UINT8) for s in sources]
    out = ins[0].new_empty(nbytes)
    outs = [out[o : o + x.numel() * k] for o, x in zip(offsets, ins)]
    if len(ins) == 1:
        return GatherHandle(group._allgather_base(outs[0], ins[0], _ASYNC), out)
    coalesced = _COALESCED.get(group)
    if coalesced is None:
        coalesced = _COALESCED[group] = dist.get_backend(group) != "gloo"
    if coalesced:
        return GatherHandle(group.allgather_into_tensor_coalesced(outs, ins, _ASYNC), out)
    return GatherHandle(_Works([group._allgather_base(o, x, _ASYNC) for o, x in zip(outs, ins)]), out)


_COALESCED: dict = {}  # group -> coalesced (not under gloo)


class _Works(NamedTuple):
    """Several all-gathers in flight, waited for together."""

    works: list

    def wait(self) -> None:
        for w in self.works:
            w.wait()


gather_start = _register("fp8shard_gather_start", _gather_start_meta, _gather_start)


def _gather_wait_meta(handle, restorer):
    raise NotImplementedError("fp8shard_gather_wait is bound by the rewrite with the restored proxies as its outputs")


def _gather_wait(handle: GatherHandle, restorer: Restorer) -> tuple:
    handle.work.wait()
    return restorer.restore(handle.buffer)


gather_wait = _register("fp8shard_gather_wait", _gather_wait_meta, _gather_wait)


def _gather_next_meta(handle, restorer, shard, offset: int, nbytes: int, k: int, group):
    raise NotImplementedError("fp8shard_gather_next is bound by the rewrite with the restored proxies and the next "
                              "handle as its outputs")


def _gather_next(handle: GatherHandle, restorer: Restorer, shard: torch.Tensor, offset: int, nbytes: int,
                 k: int, group) -> tuple:
    """One bucket's wait and a later bucket's start, as one call."""
    return (*_gather_wait(handle, restorer), _gather_start(shard, offset, nbytes, k, group))


gather_next = _register("fp8shard_gather_next", _gather_next_meta, _gather_next)


# ---- forward: compact copies of saved views ----


class CompactCopies:
    """One call site's compact copies: each a fresh tensor of the view's own bytes, its dimensions in the
    view's stride order so readers see the same layout. The orders and the views' copy items
    (:func:`~thunder_fp8shard.runtime.multicopy.strided_item`; None: torch copies it) are kept while the views'
    strides stay the same."""

    __slots__ = ("strides", "orders", "items", "launch")

    def __init__(self):
        self.strides: list | None = None
        self.orders: list | None = None
        self.items: list | None = None
        self.launch: multicopy.Copies | None = None  # the views' copies alone (fp8shard_compact)

    def update(self, views) -> None:
        """Works the orders and items out again where the views' strides changed."""
        strides = [v.stride() for v in views]
        if strides != self.strides:
            self.orders = [_stride_order(st) for st in strides]
            self.items = [multicopy.strided_item(v.shape, st, v.element_size()) for v, st in zip(views, strides)]
            self.strides, self.launch = strides, _UNSET

    def empties(self, views, sources: list[int], targets: list[int]) -> list[torch.Tensor]:
        """The views' compact copies, allocated; the items' addresses appended to ``sources`` and ``targets`` for
        the caller's launch, and the views that are no item copied now."""
        out = []
        for v, order, item in zip(views, self.orders, self.items):
            c = torch.empty_permuted(v.shape, order, dtype=v.dtype, device=v.device)
            if item is None:
                c.copy_(v)
            else:
                sources.append(v.data_ptr())
                targets.append(c.data_ptr())
            out.append(c)
        return out

    def __call__(self, views) -> tuple:
        self.update(views)
        if self.launch is _UNSET:
            self.launch = _copies_on(views, [i for i in self.items if i is not None])
        if self.launch is None:
            return tuple([torch.empty_permuted(v.shape, order, dtype=v.dtype, device=v.device).copy_(v)
                          for v, order in zip(views, self.orders)])
        sources, targets = [], []
        out = self.empties(views, sources, targets)
        self.launch(sources, targets)
        return tuple(out)

    def __repr__(self) -> str:  # printed in the trace
        return "CompactCopies()"


def _stride_order(stride) -> list[int]:
    """The dimensions from the largest stride to the smallest (stable: equal strides keep their order), the order
    of a view's compact copy."""
    return sorted(range(len(stride)), key=lambda d: -stride[d])


def _compact_meta(views, copies=None):
    return tuple(TensorProxy(like=v, requires_grad=False) for v in views)


def _compact(views, copies: CompactCopies | None = None) -> tuple:
    """A compact copy of each view (``copies``: the call site's; None: worked out anew)."""
    return (copies or CompactCopies())(views)


compact = _register("fp8shard_compact", _compact_meta, _compact)


# ---- run-time checks against the plan ----


def _audit_meta(saved, audit):
    return None


def _audit(saved, audit) -> None:
    audit(saved)


audit = _register("fp8shard_audit", _audit_meta, _audit)


def _calibrate_meta(calibration):
    return None


def _calibrate(calibration) -> None:
    calibration()


calibrate = _register("fp8shard_calibrate", _calibrate_meta, _calibrate)

