"""CPU cost of one ``fp8shard_shard`` call and of its parts, outside a training step (issue #43: where a shard op's
150-220 µs a call in the step go).

Rank 0 of 8 in torch's fake process group; a bucket of eight FP8 weight copies of Llama-2-7b's shapes (TE
``Float8Tensor``\\ s on CUDA where TE is installed, else plain ``float8_e4m3fn`` tensors) and, for the shard ops that
carry them, five compaction views shaped like LitGPT's ``v`` (a strided view of ``qkv``). Each variant is called
``--calls`` times after a warm-up; the figure is the median per call of the wall and the thread CPU time, the device
synchronized every ten calls outside the timings. The parts: the payloads taken apart and put back, this rank's
slice copied, the compaction copies, and a bare ``clone`` of the slice's bytes; and the shard op where its return
frees the copies' buffers, as in a step (elsewhere they stay held between calls).
With ``--cold`` each timed call follows unrelated work (:func:`thrash`), so the op's code and data come cold, as in
a step, where a shard op took 5-6 times its warm cost (s26).
Usage: python benchmarks/shard_op_cost.py [--device cuda] [--calls 300] [--cold] [--out shard_op_cost.json]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

COLD = False  # --cold
SHAPES = [(12288, 4096), (4096, 4096), (11008, 4096), (11008, 4096), (4096, 11008)] * 2  # two blocks' weights
MEMBERS = 8


def thrash(state={}) -> None:  # noqa: B006 (kept between calls)
    """Work unrelated to the op, as a step does between two shard ops: a walk over many Python objects, a touch of
    64 MiB, a torch matmul; the op's code and data then come cold from memory."""
    import random

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--out", default=None)
    parser.add_argument("--cold", action="store_true", help="unrelated work before each timed call (thrash): the "
                        "op's code and data cold, as in a step")
    args = parser.parse_args()
    global COLD
    COLD = args.cold
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
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
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        arm()
        ops._shard(buckets, spec5, views)
    prof.disable()
    sync()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(15)
    for name, r in rows.items():
        print(f"{r['wall_us']:9.2f} us wall {r['cpu_us']:9.2f} us CPU  {name}")
    print(text.getvalue())
    result = {"kind": "shard_op_cost", "cold": args.cold, "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
              "payload": type(objs[0]).__name__, "calls": args.calls, "rows": rows, "cprofile": text.getvalue()}
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


if __name__ == "__main__":
    main()
