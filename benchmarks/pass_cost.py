"""Cost of the ShardIntermediates pass against the whole first call of a Thunder-compiled model (CPU, gloo).

A litgpt-style Llama with fake-FP8 linears (``thunder_fp8shard.testing.toy_models.FakeFP8Llama``, small widths) under
FSDPTransform ZeRO-3 on 2 gloo ranks. On rank 0 we time the pass's two post-optimization hooks (forward and
backward) and the whole first call (trace, autodiff, both hooks, compile, run) plus its backward.
Usage: python benchmarks/pass_cost.py [--layers 8 16 32] [--out benchmarks/results/pass_cost.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time


def measure(rank: int, world_size: int, n_layer: int) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    import thunder
    import torch
    from thunder.distributed import FSDPType
    from thunder.distributed.transforms.fsdp_v2 import FSDPTransform

    from thunder_fp8shard import ShardIntermediates
    from thunder_fp8shard.testing.toy_models import FakeFP8Llama

    class Timed(ShardIntermediates):
        seconds = 0.0

        def transform_trace_post_optimization(self, trace, **kwargs):
            start = time.perf_counter()
            try:
                return super().transform_trace_post_optimization(trace, **kwargs)
            finally:
                Timed.seconds += time.perf_counter() - start

    torch.manual_seed(0)
    shard = Timed()
    fsdp = FSDPTransform(device=torch.device("cpu"), sharding_strategy=FSDPType.ZERO3)
    jm = thunder.jit(FakeFP8Llama(n_layer), transforms=[fsdp, shard])
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank))
    start = time.perf_counter()
    jm(idx).sum().backward()
    first_call = time.perf_counter() - start
    plan = shard.plans[-1]
    return {
        "n_layer": n_layer, "first_call_s": first_call, "pass_s": Timed.seconds, "pass_fraction": Timed.seconds / first_call,
        "candidates": len(plan.decisions), "sharded": len(plan.sharded),
        "forward_bound_symbols": len(thunder.last_traces(jm)[-1].bound_symbols),
        "backward_bound_symbols": len(thunder.last_backward_traces(jm)[-1].bound_symbols),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--out", default="benchmarks/results/pass_cost.json")
    args = parser.parse_args()
    from thunder_fp8shard.testing.harness import run_on_ranks

    rows = [run_on_ranks(measure, 2, n)[0] for n in args.layers]
    for a, b in zip(rows, rows[1:]):
        b["pass_time_ratio_vs_half_the_layers"] = b["pass_s"] / a["pass_s"] if b["n_layer"] == 2 * a["n_layer"] else None
    machine = {"machine": platform.machine(), "processor": platform.processor(), "cpus": os.cpu_count(),
               "python": platform.python_version(), "note": "2 gloo ranks on this CPU machine; rank 0's figures"}
    with open(args.out, "w") as f:
        json.dump({"machine": machine, "rows": rows}, f, indent=2)
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
