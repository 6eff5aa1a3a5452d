"""CPU microseconds of single calls of the pass's run-time operators and of what they are made of, each timed alone
outside a training step; torch, TE and the pass are imported by the subcommand that runs. Subcommands:

- ``ops [--repeat 20000]``: the pass's forward operators on tiny tensors (no device, no collective);
- ``shard [--device cuda] [--calls 300] [--cold] [--out F]``: one ``fp8shard_shard`` call and its parts, with TE
  weight copies on CUDA (``--cold``: each call after unrelated work, as in a step);
- ``te [--repeat 200] [--world-size 8] [--one-kernel] [--out F]``: the TE operations around an FP8 weight and the
  pass's operators on a bucket of TE weights (CUDA and TE).
"""

from __future__ import annotations

import cProfile
import functools
import inspect
import io
import json
import pstats
import random
import statistics
import time
import timeit

from benchlib.reporting import subcommands

COLD = False  # shard --cold
SHAPES = [(12288, 4096), (4096, 4096), (11008, 4096), (11008, 4096), (4096, 11008)] * 2  # shard: two blocks' weights
MEMBERS = 8


def fake_rank0(world_size: int):
    """Rank 0 of ``world_size`` in torch's fake process group (collectives move nothing); ``torch.distributed``."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    return dist


def cprofiled(calls: int, top: int, *fns) -> str:
    """``cProfile``'s ``top`` functions by own time over ``calls`` rounds of calling ``fns`` in turn, as text."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        for fn in fns:
            fn()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def best_us(fn, repeat: int) -> float:
    """The best of 5 runs of ``repeat`` calls, per call."""
    fn()  # first call: works out what later calls keep
    return min(timeit.repeat(fn, number=repeat, repeat=5)) / repeat * 1e6


def ops_cost(args) -> None:
    """CPU cost of one call of the pass's forward run-time operators, in microseconds (no device, no collective).
    Times what a step pays in Python for the compaction copies (``fp8shard_compact`` of one and of four saved views,
    the shape of LitGPT's ``v``, shrunk) and, where this version of the pass has them, the two first-call checks once
    they are done (``fp8shard_audit``, ``fp8shard_calibrate``): each through the operator's implementation as the
    trace calls it (``ops._<name>``, the module function each operator's ``<name>_impl`` looks up and calls). Tiny
    tensors, so that the figure is the Python around the copy. Prints a line a call, then the figures as JSON.
    """
    import torch

    from thunder_fp8shard.runtime import ops

    qkv = torch.randn(1, 4, 8, 3, 16)  # (batch, groups, seq, q/k/v, head dim): v is a strided view of it
    v = qkv[:, :, :, 2].transpose(1, 2)
    views = (v, v[:, :1], v[:, 1:], v.transpose(2, 3))
    rows = {}
    compact = ops._compact
    extra = _extra_args(ops)
    rows["fp8shard_compact, 1 view"] = best_us(lambda: compact((v,), *extra), args.repeat)
    rows["fp8shard_compact, 4 views"] = best_us(lambda: compact(views, *extra), args.repeat)
    rows["torch.empty_like + copy_, 1 view (floor)"] = best_us(lambda: torch.empty_like(v).copy_(v), args.repeat)
    if hasattr(ops, "_audit"):
        from thunder_fp8shard.runtime.audit import SavedAudit

        a = _blank(SavedAudit, expected=[], names=[])
        a.done, a.counting = True, False
        audit = ops._audit
        rows["fp8shard_audit, done"] = best_us(lambda: audit((v,), a), args.repeat)
    if hasattr(ops, "_calibrate"):
        from thunder_fp8shard.runtime.audit import Calibration

        c = _blank(Calibration, audit=a)
        c.done = True
        calibrate = ops._calibrate
        rows["fp8shard_calibrate, done"] = best_us(lambda: calibrate(c), args.repeat)
    for name, us in rows.items():
        print(f"{us:8.2f} us  {name}")
    print(json.dumps({k: round(us, 3) for k, us in rows.items()}))


def _blank(cls, **given):
    """``cls`` made with ``given`` and None for its other required arguments (their names differ by version)."""
    required = [p.name for p in inspect.signature(cls).parameters.values() if p.default is p.empty]
    return cls(*[given.get(name) for name in required])


def _extra_args(ops) -> tuple:
    """The call-site constants ``fp8shard_compact`` takes after its views, where this version has them."""
    if hasattr(ops, "CompactCopies"):
        return (ops.CompactCopies(),)
    return ()


def thrash(state={}) -> None:  # noqa: B006 (kept between calls)
    """Work unrelated to the op, as a step does between two shard ops: a walk over many Python objects, a touch of
    64 MiB, a torch matmul; the op's code and data then come cold from memory."""
    import torch

    if not state:
        state["objs"] = {i: [i, str(i)] for i in range(300_000)}
        state["bytes"] = bytearray(64 << 20)
    objs, big = state["objs"], state["bytes"]
    sum(len(objs[k][1]) for k in random.sample(range(300_000), 20_000))
    big[::4096] = bytes((b + 1) & 255 for b in big[::4096])
    torch.randn(256, 256) @ torch.randn(256, 256)


def timed(fn, arm, calls: int, sync) -> dict:
    """Median wall and thread-CPU microseconds a call of ``fn`` (``arm()`` before each call, untimed)."""
    for _ in range(20):
        arm()
        fn()
    sync()
    wall, cpu = [], []
    for i in range(calls):
        arm()
        if COLD:
            sync()
            thrash()
        w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        fn()
        c1, w1 = time.thread_time_ns(), time.perf_counter_ns()
        wall.append((w1 - w0) / 1e3)
        cpu.append((c1 - c0) / 1e3)
        if i % 10 == 9:
            sync()
    return {"wall_us": round(statistics.median(wall), 2), "cpu_us": round(statistics.median(cpu), 2)}


def shard_cost(args) -> None:
    """CPU cost of one ``fp8shard_shard`` call and of its parts, outside a training step (issue #43: where a shard
    op's 150-220 µs a call in the step go).
    Rank 0 of 8 in torch's fake process group; a bucket of eight FP8 weight copies of Llama-2-7b's shapes (TE
    ``Float8Tensor``\\ s on CUDA where TE is installed, else plain ``float8_e4m3fn`` tensors) and, for the shard ops
    that carry them, five compaction views shaped like LitGPT's ``v`` (a strided view of ``qkv``). Each variant is
    called ``--calls`` times after a warm-up; the figure is the median per call of the wall and the thread CPU time,
    the device synchronized every ten calls outside the timings. The parts: the payloads taken apart and put back,
    this rank's slice copied, the compaction copies, and a bare ``clone`` of the slice's bytes; and the shard op where
    its return frees the copies' buffers, as in a step (elsewhere they stay held between calls).
    With ``--cold`` each timed call follows unrelated work (:func:`thrash`), so the op's code and data come cold, as
    in a step, where a shard op took 5-6 times its warm cost (s26).
    """
    global COLD
    COLD = args.cold
    import torch

    dist = fake_rank0(8)
    from thunder_fp8shard.planning.layout import bucket_layout
    from thunder_fp8shard.runtime import ops, payload

    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    objs = _weights(torch, dev)
    held = [(o, dict((a, getattr(o, a)) for a in ("_data", "_transpose") if hasattr(o, "_data"))) for o in objs]

    def arm(fresh: bool = False):  # every copy holds its buffers again (a shard op takes them); ``fresh``: new
        # buffers that only the copies hold, so that the shard op's return frees them, as in a step
        for o, attrs in held:
            for a, t in attrs.items():
                setattr(o, a, torch.empty_like(t) if fresh and t is not None else t)

    sizes = []
    for o in objs:
        bufs, _ = payload.take(o)
        sizes += [b.nbytes for b in bufs]
    arm()
    lay = bucket_layout(sizes, 8)
    names = (tuple(f"w{i}" for i in range(len(objs))),)
    qkv = torch.randn(1, 4096, 32, 3, 128, device=dev, dtype=torch.bfloat16)
    views = tuple(qkv[:, :, :, 2].transpose(1, 2) for _ in range(5))
    spec0 = ops.ShardSpec(dist.group.WORLD, 8, (lay.shard_nbytes,), "slice", False, names)
    spec5 = ops.ShardSpec(dist.group.WORLD, 8, (lay.shard_nbytes,), "slice", False, names)
    buckets = (tuple(objs),)
    rows = {}
    rows["fp8shard_shard, 8 copies"] = timed(lambda: ops._shard(buckets, spec0), arm, args.calls, sync)
    rows["fp8shard_shard, 8 copies and 5 compaction views"] = timed(
        lambda: ops._shard(buckets, spec5, views), arm, args.calls, sync)

    rows["fp8shard_shard, 8 copies whose buffers it frees"] = timed(lambda: ops._shard(buckets, spec0),
                                                                     lambda: arm(fresh=True), args.calls, sync)

    def take_give():
        for o in objs:
            bufs, member = payload.take(o)
            payload.give(member, bufs)

    rows["the 8 payloads taken apart and put back"] = timed(take_give, arm, args.calls, sync)
    flat = [b for o in objs for b in payload.take(o)[0]]
    arm()
    rows["this rank's slice copied (_slice)"] = timed(lambda: ops._slice(spec0, spec0.program, flat), arm, args.calls,
                                                      sync)
    piece = flat[0].view(-1)[: lay.shard_nbytes]
    rows["a bare clone of the slice's bytes"] = timed(lambda: piece.clone(), arm, args.calls, sync)
    copies = ops.CompactCopies()
    rows["5 compaction copies (CompactCopies)"] = timed(lambda: copies(views), arm, args.calls, sync)
    rows["5 clones of the views"] = timed(lambda: [v.clone() for v in views], arm, args.calls, sync)
    text = cprofiled(args.calls, 15, arm, functools.partial(ops._shard, buckets, spec5, views))
    sync()
    for name, r in rows.items():
        print(f"{r['wall_us']:9.2f} us wall {r['cpu_us']:9.2f} us CPU  {name}")
    print(text)
    result = {"kind": "shard_op_cost", "cold": args.cold,
              "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
              "payload": type(objs[0]).__name__, "calls": args.calls, "rows": rows, "cprofile": text}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


def _weights(torch, dev) -> list:
    """Eight FP8 copies of weights: TE ``Float8Tensor``\\ s where TE is installed and the device is CUDA."""
    shapes = SHAPES[:MEMBERS]
    if dev.type == "cuda":
        try:
            import transformer_engine_torch as tex
            from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer
        except ImportError:
            pass
        else:
            q = Float8Quantizer(scale=torch.ones(1, device=dev), amax=torch.zeros(1, device=dev),
                                fp8_dtype=tex.DType.kFloat8E4M3)
            q.set_usage(rowwise=True, columnwise=False)
            return [q(torch.randn(s, device=dev, dtype=torch.bfloat16)) for s in shapes]
    return [torch.randn(s, device=dev).to(torch.float8_e4m3fn) for s in shapes]


def issue_us(fn, repeat: int, sync) -> float:
    """The median of 5 runs of ``repeat`` calls, per call (issue time; the device drained before each run)."""
    fn()
    runs = []
    for _ in range(5):
        sync()
        t = time.perf_counter()
        for _ in range(repeat):
            fn()
        runs.append((time.perf_counter() - t) / repeat * 1e6)
    return sorted(runs)[2]


def te_cost(args) -> None:
    """CPU microseconds one call of the operations around a TransformerEngine FP8 weight costs on the device: what the
    pass's run-time operators do a step (cast a shard, build a ``Float8Tensor``, make or cut its transpose, shard and
    gather buckets of them), each timed alone on real tensors of Llama-2-7b's weight shapes (the host's issue time: the
    calls are asynchronous; the device is synchronized between measurements only). Needs CUDA and TE."""
    if args.one_kernel:
        from benchlib import collectives

        collectives.install()
    import torch
    import transformer_engine.pytorch  # noqa: F401  (loads its extension)
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer, Float8Tensor
    from transformer_engine.pytorch.tensor.storage.float8_tensor_storage import Float8TensorStorage

    n = args.world_size
    dist = fake_rank0(n)
    dev = torch.device("cuda")
    sync = torch.cuda.synchronize
    out, inp = 11008, 4096
    w = torch.randn(out, inp, dtype=torch.bfloat16, device=dev)
    q = Float8Quantizer(torch.ones(1, device=dev), torch.zeros(1, device=dev), tex.DType.kFloat8E4M3,
                        rowwise=True, columnwise=True)
    full = q(w)
    rows = Float8Quantizer(torch.ones(1, device=dev), torch.zeros(1, device=dev), tex.DType.kFloat8E4M3,
                           rowwise=True, columnwise=False)
    rows.internal = True
    data = full._data if full._data is not None else full._transpose.t().contiguous()
    shard_rows = w[: out // n]

    def build():
        return Float8Tensor(shape=data.shape, dtype=torch.bfloat16, data=data, fp8_scale_inv=full._scale_inv,
                            fp8_dtype=full._fp8_dtype, data_transpose=None, quantizer=q, requires_grad=False,
                            device=dev)

    def columnwise():
        build().update_usage(rowwise_usage=False, columnwise_usage=True)

    cols = inp // n
    cost = functools.partial(issue_us, repeat=args.repeat, sync=sync)
    r = {}
    r["cast full weight, rowwise + columnwise (TE's own cast in the linear)"] = cost(lambda: q(w))
    r["cast this rank's rows, rowwise only (quantize_impl)"] = cost(lambda: rows.quantize_impl(shard_rows))
    dst = rows.quantize_impl(shard_rows)  # a storage to cast into again: fresh buffers, no new object

    def cast_into():
        dst._data = torch.empty(shard_rows.shape, dtype=torch.uint8, device=dev)
        dst._scale_inv = torch.empty(1, dtype=torch.float32, device=dev)
        tex.quantize(shard_rows, rows, dst, None)

    r["cast this rank's rows into fresh buffers of a kept storage (tex.quantize with an output)"] = cost(cast_into)
    r["Float8Tensor(...) from a gathered buffer"] = cost(build)
    r["Float8TensorStorage(...) from a gathered buffer"] = cost(
        lambda: Float8TensorStorage(data=data, fp8_scale_inv=full._scale_inv, fp8_dtype=full._fp8_dtype,
                                    data_transpose=None, quantizer=q, fake_dtype=torch.bfloat16))
    r["Float8Tensor(...) + update_usage(columnwise only): the full transpose"] = cost(columnwise)
    r["tex.fp8_transpose of the full weight"] = cost(lambda: tex.fp8_transpose(data, full._fp8_dtype, out=None))
    r["this rank's 1/N of the transpose: torch.empty + copy_ of a column block"] = cost(
        lambda: torch.empty((cols, out), dtype=torch.uint8, device=dev).copy_(data[:, :cols].t()))
    r["clone of 1/N of the transpose bytes (a shard op's one copy)"] = cost(
        lambda: full._transpose.view(-1)[: full._transpose.numel() // n].clone())
    pieces = [full._transpose.view(-1)[: 1 << 20] for _ in range(8)]
    r["torch.cat of 8 pieces (a shard op's copy of 8 members)"] = cost(lambda: torch.cat(pieces))
    shard = torch.empty(out * inp // n, dtype=torch.uint8, device=dev)
    group = dist.group.WORLD
    from torch.distributed.distributed_c10d import AllgatherOptions

    opts = AllgatherOptions()
    opts.asyncOp = True
    r["fake group _allgather_base (N copies)"] = cost(
        lambda: group._allgather_base(shard.new_empty(shard.numel() * n), shard, opts).wait())
    r["one-kernel all-gather copy (expand)"] = cost(
        lambda: shard.new_empty(shard.numel() * n).view(n, -1).copy_(shard.view(1, -1).expand(n, -1)))
    shards5 = [torch.empty(x, dtype=torch.uint8, device=dev) for x in (6 << 20, 2 << 20, 5 << 20, 5 << 20, 5 << 20)]
    r["5 x _allgather_base (a layer's weights one by one)"] = cost(
        lambda: [group._allgather_base(x.new_empty(x.numel() * n), x, opts) for x in shards5])
    r["allgather_into_tensor_coalesced of the 5 (one call)"] = cost(
        lambda: group.allgather_into_tensor_coalesced([x.new_empty(x.numel() * n) for x in shards5], shards5, opts))
    r["torch.empty + copy_ of 1 MB (floor)"] = cost(
        lambda: torch.empty(1 << 20, dtype=torch.uint8, device=dev).copy_(pieces[0]))
    # the pass's operators on a bucket of the saved kind (columnwise only: the transpose), Llama-2-7b's layer shapes
    from thunder_fp8shard.planning.layout import bucket_layout
    from thunder_fp8shard.runtime import ops

    shapes = [(4096, 12288), (4096, 4096), (4096, 11008), (4096, 11008), (11008, 4096)]  # transposes: (in, out)
    transposes = [torch.randint(0, 255, s, dtype=torch.uint8, device=dev) for s in shapes]

    def saved():
        return tuple(Float8Tensor(shape=(s[1], s[0]), dtype=torch.bfloat16, data=None, fp8_scale_inv=full._scale_inv,
                                  fp8_dtype=full._fp8_dtype, data_transpose=t, quantizer=q, requires_grad=False,
                                  device=dev) for s, t in zip(shapes, transposes))

    lay = bucket_layout([t.numel() for t in transposes], n)
    spec = ops.ShardSpec(group, n, (lay.shard_nbytes,), "slice", False, (tuple(f"w{i}" for i in range(5)),))
    build5 = cost(saved)
    r["5 saved Float8Tensors built (subtracted below)"] = build5
    r["fp8shard_shard of one bucket of 5 TE members (a layer's), less the build"] = cost(
        lambda: ops._shard((saved(),), spec)) - build5
    shard5, restorer = ops._shard((saved(),), spec)[:2]

    def gather_next():
        _, r_ = ops._shard((saved(),), spec)[:2]
        h = ops._gather_start(shard5, 0, lay.shard_nbytes, n, group)
        return ops._gather_next(h, r_, shard5, 0, lay.shard_nbytes, n, group)

    shard_us = cost(lambda: ops._shard((saved(),), spec))
    start_us = cost(lambda: ops._gather_start(shard5, 0, lay.shard_nbytes, n, group))
    r["fp8shard_gather_next of that bucket (fake group), less a shard op and a start"] = (
        cost(gather_next) - shard_us - start_us)
    r["fp8shard_gather_start of that bucket (fake group)"] = start_us
    for name, us in r.items():
        print(f"{us:9.2f} us  {name}")
    # device time of the simulated all-gather's two renders, a bucket's shard (a layer's FP8 transposes / N)
    src = torch.empty(lay.shard_nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty(lay.shard_nbytes * n, dtype=torch.uint8, device=dev)
    renders = {"broadcast copy_ (uint8)": lambda: dst.view(n, -1).copy_(src.reshape(1, -1).expand(n, -1)),
               "cat of N times the input": lambda: torch.cat([src] * n, out=dst)}
    for name, fn in renders.items():
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        sync()
        start.record()
        for _ in range(20):
            fn()
        end.record()
        sync()
        ms = start.elapsed_time(end) / 20
        r[f"device µs of a simulated all-gather of {dst.numel():,} B: {name}"] = ms * 1e3
        print(f"{ms:9.3f} ms device, {dst.numel() / ms / 1e6:7.1f} GB/s written: all-gather render {name}")
    for what, fn in (("fp8shard_shard with its bucket's 5 saved Float8Tensors built",
                      lambda: ops._shard((saved(),), spec)),
                     ("a shard op, a start and fp8shard_gather_next", gather_next)):
        sync()
        text = cprofiled(args.repeat, 25, fn)
        print(f"\ncProfile of {args.repeat} calls of {what} (own time):")
        print(text, end="")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"kind": "te_call_cost", "device": torch.cuda.get_device_name(), "world_size": n,
                       "sim_collectives": "one-kernel" if args.one_kernel else "fake-group",
                       "weight": [out, inp], "us_per_call": r}, f, indent=1)


def main(argv=None) -> None:
    parser, add = subcommands(__doc__)
    p = add("ops", ops_cost)
    p.add_argument("--repeat", type=int, default=20000)
    p = add("shard", shard_cost)
    p.add_argument("--device", default="cuda")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--out", default=None)
    p.add_argument("--cold", action="store_true", help="unrelated work before each timed call (thrash): the "
                   "op's code and data cold, as in a step")
    p = add("te", te_cost)
    p.add_argument("--repeat", type=int, default=200)
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--one-kernel", action="store_true", help="collectives one kernel each (benchlib.collectives)")
    p.add_argument("--out")
    a = parser.parse_args(argv)
    a.run(a)


if __name__ == "__main__":
    main()
