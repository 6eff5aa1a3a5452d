"""CPU microseconds one call of the operations around a TransformerEngine FP8 weight costs on the device: what the
pass's run-time operators do a step (cast a shard, build a ``Float8Tensor``, make or cut its transpose, shard and
gather buckets of them), each timed alone on real tensors of Llama-2-7b's weight shapes (the host's issue time:
the calls are asynchronous; the device is synchronized between measurements only). Needs CUDA and TE.
Usage: python benchmarks/te_call_cost.py [--repeat 200] [--one-kernel] [--out x.json]
"""

from __future__ import annotations

import argparse
import json
import time


def per_call_us(fn, repeat: int, sync) -> float:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--one-kernel", action="store_true", help="collectives one kernel each (benchlib.collectives)")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.one_kernel:
        from benchlib import collectives

        collectives.install()
    import torch
    import torch.distributed as dist
    import transformer_engine.pytorch  # noqa: F401  (loads its extension)
    import transformer_engine_torch as tex
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer, Float8Tensor
    from transformer_engine.pytorch.tensor.storage.float8_tensor_storage import Float8TensorStorage

    n = args.world_size
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
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
    r = {}
    r["cast full weight, rowwise + columnwise (TE's own cast in the linear)"] = per_call_us(lambda: q(w), args.repeat, sync)
    r["cast this rank's rows, rowwise only (quantize_impl)"] = per_call_us(lambda: rows.quantize_impl(shard_rows),
                                                                          args.repeat, sync)
    dst = rows.quantize_impl(shard_rows)  # a storage to cast into again: fresh buffers, no new object

    def cast_into():
        dst._data = torch.empty(shard_rows.shape, dtype=torch.uint8, device=dev)
        dst._scale_inv = torch.empty(1, dtype=torch.float32, device=dev)
        tex.quantize(shard_rows, rows, dst, None)

    r["cast this rank's rows into fresh buffers of a kept storage (tex.quantize with an output)"] = per_call_us(
        cast_into, args.repeat, sync)
    r["Float8Tensor(...) from a gathered buffer"] = per_call_us(build, args.repeat, sync)
    r["Float8TensorStorage(...) from a gathered buffer"] = per_call_us(
        lambda: Float8TensorStorage(data=data, fp8_scale_inv=full._scale_inv, fp8_dtype=full._fp8_dtype,
                                    data_transpose=None, quantizer=q, fake_dtype=torch.bfloat16), args.repeat, sync)
    r["Float8Tensor(...) + update_usage(columnwise only): the full transpose"] = per_call_us(columnwise, args.repeat,
                                                                                             sync)
    r["tex.fp8_transpose of the full weight"] = per_call_us(lambda: tex.fp8_transpose(data, full._fp8_dtype, out=None),
                                                            args.repeat, sync)
    r["this rank's 1/N of the transpose: torch.empty + copy_ of a column block"] = per_call_us(
        lambda: torch.empty((cols, out), dtype=torch.uint8, device=dev).copy_(data[:, :cols].t()), args.repeat, sync)
    r["clone of 1/N of the transpose bytes (a shard op's one copy)"] = per_call_us(
        lambda: full._transpose.view(-1)[: full._transpose.numel() // n].clone(), args.repeat, sync)
    pieces = [full._transpose.view(-1)[: 1 << 20] for _ in range(8)]
    r["torch.cat of 8 pieces (a shard op's copy of 8 members)"] = per_call_us(lambda: torch.cat(pieces), args.repeat,
                                                                              sync)
    shard = torch.empty(out * inp // n, dtype=torch.uint8, device=dev)
    group = dist.group.WORLD
    from torch.distributed.distributed_c10d import AllgatherOptions

    opts = AllgatherOptions()
    opts.asyncOp = True
    r["fake group _allgather_base (N copies)"] = per_call_us(
        lambda: group._allgather_base(shard.new_empty(shard.numel() * n), shard, opts).wait(), args.repeat, sync)
    r["one-kernel all-gather copy (expand)"] = per_call_us(
        lambda: shard.new_empty(shard.numel() * n).view(n, -1).copy_(shard.view(1, -1).expand(n, -1)), args.repeat,
        sync)
    shards5 = [torch.empty(x, dtype=torch.uint8, device=dev) for x in (6 << 20, 2 << 20, 5 << 20, 5 << 20, 5 << 20)]
    r["5 x _allgather_base (a layer's weights one by one)"] = per_call_us(
        lambda: [group._allgather_base(x.new_empty(x.numel() * n), x, opts) for x in shards5], args.repeat, sync)
    r["allgather_into_tensor_coalesced of the 5 (one call)"] = per_call_us(
        lambda: group.allgather_into_tensor_coalesced([x.new_empty(x.numel() * n) for x in shards5], shards5, opts),
        args.repeat, sync)
    r["torch.empty + copy_ of 1 MB (floor)"] = per_call_us(
        lambda: torch.empty(1 << 20, dtype=torch.uint8, device=dev).copy_(pieces[0]), args.repeat, sync)
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
    build5 = per_call_us(saved, args.repeat, sync)
    r["5 saved Float8Tensors built (subtracted below)"] = build5
    r["fp8shard_shard of one bucket of 5 TE members (a layer's), less the build"] = per_call_us(
        lambda: ops._shard((saved(),), spec), args.repeat, sync) - build5
    shard5, restorer = ops._shard((saved(),), spec)[:2]

    def gather_next():
        _, r_ = ops._shard((saved(),), spec)[:2]
        h = ops._gather_start(shard5, 0, lay.shard_nbytes, n, group)
        return ops._gather_next(h, r_, shard5, 0, lay.shard_nbytes, n, group)

    shard_us = per_call_us(lambda: ops._shard((saved(),), spec), args.repeat, sync)
    start_us = per_call_us(lambda: ops._gather_start(shard5, 0, lay.shard_nbytes, n, group), args.repeat, sync)
    r["fp8shard_gather_next of that bucket (fake group), less a shard op and a start"] = per_call_us(
        gather_next, args.repeat, sync) - shard_us - start_us
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
    import cProfile
    import pstats

    for what, fn in (("fp8shard_shard with its bucket's 5 saved Float8Tensors built", lambda: ops._shard((saved(),), spec)),
                     ("a shard op, a start and fp8shard_gather_next", gather_next)):
        prof = cProfile.Profile()
        sync()
        prof.enable()
        for _ in range(args.repeat):
            fn()
        prof.disable()
        print(f"\ncProfile of {args.repeat} calls of {what} (own time):")
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"kind": "te_call_cost", "device": torch.cuda.get_device_name(), "world_size": n,
                       "sim_collectives": "one-kernel" if args.one_kernel else "fake-group",
                       "weight": [out, inp], "us_per_call": r}, f, indent=1)


if __name__ == "__main__":
    main()
