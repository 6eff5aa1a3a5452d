"""CPU cost of the pass's run-time operators, per call, outside any model: what they add to a CPU-bound step.

Thunder's benchmark step on Llama-2-7b is CPU-bound (the GPU waits for Python launches), so every microsecond the
operators spend on the CPU is step time. This measures it directly: a forward of ``--tensors`` shard calls, then a
backward of all-gathers issued ``prefetch`` buckets ahead and waited for in reverse order, timed with
``perf_counter`` on the CPU (no synchronization inside a phase), over ``--steps`` steps; the medians per call go
to stdout and ``--out``, with the CPU milliseconds a step of ``--tensors`` tensors spends in them.

Each shard op's :class:`~thunder_fp8shard.ops.ShardSpec` is made once and kept across the steps, as the rewrite
bakes it into the trace (the op works out its layouts on its first call, an untimed warm-up step here).
``--backend fake`` runs one process in torch's fake process group (``--nproc`` ranks in name; collectives return at
once): the operators' CPU work alone, without communication, on any machine.

    python benchmarks/ops_cpu_cost.py --nproc 2 --backend nccl --te --per-op 5 --out benchmarks/results/ops.json
    python benchmarks/ops_cpu_cost.py --nproc 8 --backend fake --shape 172,64 --bucket 5   # CPU only, no communication
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tensors(n: int, shape: tuple[int, int], te: bool, device):
    import torch

    if te:
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

        q = Float8Quantizer(scale=torch.ones(1, device=device), amax=torch.zeros(1, device=device),
                            fp8_dtype=tex.DType.kFloat8E4M3)
        q.set_usage(rowwise=True, columnwise=True)

        def one():  # what TE saves for a weight: the transpose only (TE cannot quantize columnwise-only)
            f = q(torch.randn(shape, device=device, dtype=torch.bfloat16))
            f.update_usage(rowwise_usage=False, columnwise_usage=True)
            return f

        return lambda: [one() for _ in range(n)]
    return lambda: [torch.randn(shape, device=device).to(torch.float8_e4m3fn) for _ in range(n)]


def _rank(rank: int, world_size: int, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist

    from thunder_fp8shard import ops, payload
    from thunder_fp8shard.layout import bucket_layout, packed_offsets

    if cfg["backend"] == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)

    device = torch.device("cuda", rank) if cfg["backend"] == "nccl" else torch.device("cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    group = dist.group.WORLD
    barrier = (lambda: None) if cfg["backend"] == "fake" else dist.barrier
    make = _tensors(cfg["tensors"], tuple(cfg["shape"]), cfg["te"], device)
    k, per_op = cfg["bucket"], cfg["per_op"]
    times: dict[str, list[float]] = {"shard": [], "gather_start": [], "gather_wait": []}
    specs: dict[int, ops.ShardSpec] = {}  # a shard op's, by its first bucket
    for step in range(cfg["steps"]):
        objs = make()
        buckets = [objs[i : i + k] for i in range(0, len(objs), k)]
        sizes = [bucket_layout([n for o in b for n in _payload_nbytes(o, payload)], world_size).shard_nbytes
                 for b in buckets]
        shard_ops = [range(i, min(i + per_op, len(buckets))) for i in range(0, len(buckets), per_op)]
        del objs
        sync()
        barrier()
        t0 = time.perf_counter()
        saved = []  # (shard, offset, nbytes, restorer) a bucket
        for js in shard_ops:
            offsets, _ = packed_offsets([sizes[j] for j in js])
            spec = specs.setdefault(js[0], ops.ShardSpec(group, world_size, tuple(sizes[j] for j in js), "slice",
                                                         False, tuple(tuple("x" for _ in buckets[j]) for j in js)))
            shard, *restorers = ops._shard_impl(tuple(tuple(buckets[j]) for j in js), spec)
            saved += [(shard, off, sizes[j], r) for j, off, r in zip(js, offsets, restorers)]
        t1 = time.perf_counter()
        del buckets, shard, restorers
        sync()
        barrier()
        pf = cfg["prefetch"]
        order = list(reversed(saved))
        del saved
        handles = {}
        t_start = t_wait = 0.0
        for i in range(min(pf + 1, len(order))):
            a = time.perf_counter()
            handles[i] = ops._gather_start_impl(*order[i][:3], world_size, group)
            t_start += time.perf_counter() - a
        for i in range(len(order)):
            j = i + pf + 1
            if j < len(order):
                a = time.perf_counter()
                handles[j] = ops._gather_start_impl(*order[j][:3], world_size, group)
                t_start += time.perf_counter() - a
            a = time.perf_counter()
            out = ops._gather_wait_impl(handles.pop(i), order[i][3])
            t_wait += time.perf_counter() - a
            del out
        sync()
        if step:  # the first step warms the allocator and NCCL up; per call of each operator
            times["shard"].append((t1 - t0) / len(shard_ops) * 1e6)
            times["gather_start"].append(t_start / len(order) * 1e6)
            times["gather_wait"].append(t_wait / len(order) * 1e6)
    return {name: statistics.median(v) for name, v in times.items()}


def _payload_nbytes(obj, payload) -> list[int]:
    """The bytes of the buffers ``payload.take`` hands over, the object given its buffers back."""
    buffers, member = payload.take(obj)
    payload.give(member, buffers)
    return [payload.nbytes(t) for t in buffers]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--backend", choices=("gloo", "nccl", "fake"), default="gloo")
    p.add_argument("--te", action="store_true", help="TransformerEngine Float8Tensors (columnwise, as TE saves)")
    p.add_argument("--shape", default="4096,11008")
    p.add_argument("--tensors", type=int, default=160)
    p.add_argument("--bucket", type=int, default=1, help="tensors a bucket (one all-gather)")
    p.add_argument("--per-op", type=int, default=1, help="buckets a shard op")
    p.add_argument("--prefetch", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out")
    a = p.parse_args()
    from thunder_fp8shard.testing.harness import run_on_ranks

    cfg = dict(backend=a.backend, te=a.te, shape=[int(s) for s in a.shape.split(",")], tensors=a.tensors,
               bucket=a.bucket, per_op=a.per_op, prefetch=a.prefetch, steps=a.steps)
    if a.backend == "fake":  # one process, rank 0 of --nproc
        import torch

        torch.set_num_threads(1)
        res = [_rank(0, a.nproc, cfg)]
    else:
        res = run_on_ranks(_rank, a.nproc, cfg, backend=a.backend)
    us = {k: statistics.median(r[k] for r in res) for k in res[0]}
    n_buckets = -(-a.tensors // a.bucket)
    report = {"config": cfg, "world_size": a.nproc, "us_per_call_by_rank": res, "us_per_call": us,
              "calls_per_step": {"shard": -(-n_buckets // a.per_op), "gather_start": n_buckets, "gather_wait": n_buckets}}
    report["ms_per_step"] = sum(us[k] * report["calls_per_step"][k] for k in us) / 1e3
    print(json.dumps(report, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
