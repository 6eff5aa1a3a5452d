"""CPU cost of the pass in a whole Thunder training step, without communication: does it grow with depth?

Thunder's benchmark step on Llama-2-7b is CPU-bound, so what the pass adds to a step's CPU time is what it adds to
the step. ``ops_cpu_cost.py`` times the operators alone; this times them where they run, in Thunder's execution of
the rewritten forward and backward traces, so anything else the rewrite costs there is counted too.

One process joins torch's fake process group (``world_size`` ranks in name, collectives that return at once: no
communication and no waiting), so the difference between the two sides is CPU work only. It compiles the
litgpt-style fake-FP8 Llama (``toy_models.FakeFP8Llama``, small widths: kernels cost little, Python most) under
Thunder FSDP ZeRO-3 several times (``--compilations``) without and with the pass, then times interleaved steps
(forward and backward) of all of them and reports the medians of the process's CPU time a step
(``time.process_time``: what this process ran, not what other processes took from it; the wall time is kept too).
Results under a fake group are not numerically meaningful; nothing is compared.

    for n in 8 16 32; do for o in '{"min_bytes": 0}' '{"min_bytes": 0, "bucket_bytes": 0}'; do
        python benchmarks/cpu_step_cost.py --layers $n --options "$o" --compilations 2 --append; done; done
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _compile(n_layer: int, options: dict | None, transform: type | None = None):
    """A fresh model compiled under Thunder FSDP ZeRO-3, with the pass when ``options`` is given (``transform``: its
    class, default this checkout's ``ShardIntermediates``); its input, plan."""
    import thunder
    import torch
    from thunder.distributed import FSDPType
    from thunder.distributed.transforms.fsdp_v2 import FSDPTransform

    from thunder_fp8shard import ShardIntermediates
    from thunder_fp8shard.testing.toy_models import FakeFP8Llama

    torch.manual_seed(0)
    transforms = [FSDPTransform(device=torch.device("cpu"), sharding_strategy=FSDPType.ZERO3)]
    shard = (transform or ShardIntermediates)(**options) if options is not None else None
    jm = thunder.jit(FakeFP8Llama(n_layer), transforms=[*transforms, *([shard] if shard else [])])
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    jm(idx).sum().backward()
    first_call_s = time.perf_counter() - start
    jm(idx).sum().backward()  # the first call after compiling allocates more than the rest
    return jm, idx, shard.plans[-1] if shard else None, first_call_s


def measure(n_layer: int, options: dict, steps: int, compilations: int) -> dict:
    """``compilations`` compiled models a side, their steps interleaved; a side's figure is the median over its
    compilations of each one's median step. Each compilation keeps a speed of its own (memory layout, caches), so
    the spread between the compilations of one side is the floor under any difference between the sides."""
    runs = [(side, *_compile(n_layer, options if side == "with" else None))
            for _ in range(compilations) for side in ("without", "with")]
    cpu: list[list[float]] = [[] for _ in runs]
    wall: list[list[float]] = [[] for _ in runs]
    collections = {"without": [0, 0, 0], "with": [0, 0, 0]}  # Python's garbage collections by generation
    side_now = ["without"]

    def count(phase, info):
        if phase == "start":
            collections[side_now[0]][info["generation"]] += 1

    gc.callbacks.append(count)
    try:
        for _ in range(steps):
            for k, (side, jm, idx, _, _) in enumerate(runs):
                side_now[0] = side
                start, start_cpu = time.perf_counter(), time.process_time()
                jm(idx).sum().backward()
                cpu[k].append((time.process_time() - start_cpu) * 1e3)
                wall[k].append((time.perf_counter() - start) * 1e3)
    finally:
        gc.callbacks.remove(count)
    per_run = {side: [statistics.median(cpu[k]) for k, r in enumerate(runs) if r[0] == side] for side in ("without", "with")}
    median = {side: statistics.median(m) for side, m in per_run.items()}
    plan = runs[1][3]
    n_shard_ops = len({b.shard_op for b in plan.buckets})
    calls = n_shard_ops + 2 * len(plan.buckets)  # one shard call per shard op, a start and a wait per bucket
    overhead = median["with"] - median["without"]
    return {
        "n_layer": n_layer, "options": options, "steps": steps, "compilations": compilations,
        "median_step_cpu_ms": median, "per_compilation_median_cpu_ms": per_run,
        "spread_within_side_ms": {side: max(m) - min(m) for side, m in per_run.items()},
        "per_compilation_median_wall_ms": [statistics.median(w) for w in wall],
        "gc_collections_by_generation": collections,
        "overhead_ms": overhead, "overhead_pct": 100 * overhead / median["without"],
        "sharded": len(plan.sharded), "buckets": len(plan.buckets), "shard_ops": n_shard_ops, "operator_calls": calls,
        "overhead_us_per_sharded_tensor": 1e3 * overhead / len(plan.sharded),
        "overhead_us_per_operator_call": 1e3 * overhead / calls,
        "first_call_s": {side: [r[4] for r in runs if r[0] == side] for side in ("without", "with")},
        "pass_seconds": plan.pass_seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--options", action="append", type=json.loads,
                        help="ShardIntermediates options as JSON; repeat for several (default: {\"min_bytes\": 0})")
    parser.add_argument("--world-size", type=int, default=2, help="ranks the fake group claims (default 2)")
    parser.add_argument("--steps", type=int, default=40, help="timed steps of each compilation, interleaved (default 40)")
    parser.add_argument("--compilations", type=int, default=3, help="compiled models a side (default 3)")
    parser.add_argument("--out", default="benchmarks/results/cpu_step_cost.json")
    parser.add_argument("--append", action="store_true",
                        help="add the rows to --out's (one process a configuration: a fresh interpreter each)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
    rows = []
    for n_layer in args.layers:
        for options in args.options or [{"min_bytes": 0}]:
            rows.append(measure(n_layer, options, args.steps, args.compilations))
            print(json.dumps(rows[-1]), flush=True)
    machine = {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
               "torch": torch.__version__, "note": "one process, torch's fake process group, CPU tensors"}
    if args.append and os.path.exists(args.out):
        with open(args.out) as f:
            rows = json.load(f)["rows"] + rows
    with open(args.out, "w") as f:
        json.dump({"machine": machine, "world_size": args.world_size, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
