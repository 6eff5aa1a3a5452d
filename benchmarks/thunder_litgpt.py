"""The headline benchmark: Thunder's own ``thunder/benchmarks/benchmark_litgpt.py`` with and without the pass.

Thunder's installed benchmark runs unchanged. With the pass, the only change is made at run time: while the
benchmark compiles its model, ``thunder.jit`` (and ``ThunderCompiler``, under ``--compile=dynamo``) gets
``ShardIntermediates(**options)`` appended to its ``transforms`` (``benchlib.patches.pass_appended``, as in
``paired.py``).
Each side runs in its own ``torchrun`` launch, in the order given (e.g. ``without,with,without,with``), with the same
flags. Optionally one iteration before the timed window (``--profile-iter``) is profiled with ``torch.profiler``;
the profiled iteration is not timed by Thunder's benchmark, so the figures it reports are not disturbed.

One JSON per comparison: Thunder's perf-metrics dict of every run under ``"without"`` and ``"with"`` (lists, in run
order), the medians, the pass's plan (bytes, buckets, pass time), per-iteration times (iteration 0 is the
compilation) and the milliseconds of Python garbage collection in each (full collections marked), the profile
summaries (see ``time_profile.py step``), and the options, layers, world size, device and launch commands.

Usage (one GPU a rank, NCCL)::

    python benchmarks/thunder_litgpt.py --nproc 2 --order without,with,without,with \\
        --out benchmarks/results/thunder_fp8_l32.json -- --distributed_mode=fsdp --shard_mode=zero3 \\
        --model_name=Llama-2-7b-hf --micro_batch_size=1 --compile=thunder_inductor_cat \\
        --low_precision_mode=fp8-default-te --n_layers=32

Pass options: ``--options '{"candidates": "all"}'``.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from benchlib import ROOT
from benchlib.patches import pass_appended
from benchlib.reporting import flag, nvidia_smi, plan_summary, split_argv
from benchlib.steps import GcLog, gc_per_iteration


# ---- the worker: one rank of one run, inside torchrun ---------------------------------------------------------------


class _IterationClock:
    """Wraps the benchmark's data iterator: one ``next`` per iteration (gradient accumulation 1) marks its start.
    Records the start times, and profiles iteration ``profile_iter`` (from its start to the next one's)."""

    def __init__(self, it, profile_iter: int | None, trace_path: str | None):
        self.it, self.profile_iter, self.trace_path = it, profile_iter, trace_path
        self.starts: list[float] = []
        self.prof = None

    def __iter__(self):
        return self

    def __next__(self):
        import torch

        i = len(self.starts)
        if self.prof is not None and i == self.profile_iter + 1:
            torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)
            self.prof.export_chrome_trace(self.trace_path)
            self.prof = None
        self.starts.append(time.perf_counter())
        if i == self.profile_iter and self.trace_path:
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.__enter__()
        return next(self.it)


def split_cores(cpus: list[int], core_of: dict[int, int], n: int) -> list[list[int]]:
    """``cpus`` split into ``n`` sets of whole physical cores (``core_of``: cpu -> its core; SMT siblings share a
    core), as evenly as possible: no two ranks share a core, so one rank's Python cannot slow the other's."""
    cores: dict[int, list[int]] = {}
    for cpu in sorted(cpus):
        cores.setdefault(core_of.get(cpu, cpu), []).append(cpu)
    groups = list(cores.values())
    if len(groups) < n:
        raise ValueError(f"--pin-cores: {len(groups)} physical cores for {n} ranks")
    per = len(groups) // n
    return [[cpu for g in groups[k * per : (k + 1) * per] for cpu in g] for k in range(n)]


def _pin(local_rank: int, local_world: int) -> list[int]:
    """Pins this process to its share of the allowed CPUs' physical cores (see :func:`split_cores`)."""
    cpus = sorted(os.sched_getaffinity(0))
    core_of = {}
    for cpu in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
                core_of[cpu] = int(f.read().replace("-", ",").split(",")[0])
        except OSError:
            core_of[cpu] = cpu
    mine = split_cores(cpus, core_of, local_world)[local_rank]
    os.sched_setaffinity(0, mine)
    return mine


def worker(args, flags: list[str]) -> None:
    if args.pin_cores:
        pinned = _pin(int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    import torch
    import thunder.benchmarks.benchmark_litgpt as bl
    from jsonargparse import CLI

    from thunder_fp8shard import ShardIntermediates

    rank = int(os.environ.get("RANK", "0"))
    shard = ShardIntermediates(**json.loads(args.options)) if args.side == "with" else None
    clock: dict[str, _IterationClock] = {}

    train = bl.Benchmark_litGPT.train

    def timed_train(self):
        trace = os.path.join(args.workdir, f"trace_rank{rank}.json") if args.profile_iter is not None and rank == 0 else None
        clock["c"] = self.train_data_iter = _IterationClock(self.train_data_iter, args.profile_iter, trace)
        try:
            return train(self)
        finally:
            clock["c"].starts.append(time.perf_counter())  # the end of the last iteration

    bl.Benchmark_litGPT.train = timed_train
    torch.set_float32_matmul_precision("high")  # as Thunder's __main__
    metrics_path = os.path.join(args.workdir, "metrics.json")
    gc_log = GcLog()
    gc.callbacks.append(gc_log)
    try:
        with pass_appended(bl, shard):
            CLI(bl.benchmark_main, args=[*flags, "--return_metrics_as_json=true", f"--json_path={metrics_path}"])
    finally:
        gc.callbacks.remove(gc_log)
        if bl.world_size and bl.world_size > 1:
            torch.distributed.destroy_process_group()
    if rank != 0:
        return
    starts = clock["c"].starts
    extra = {"iteration_start_s": [t - starts[0] for t in starts[:-1]], "iteration_ms": [
        (b - a) * 1e3 for a, b in zip(starts, starts[1:])], **gc_per_iteration(starts, gc_log.collections)}
    if args.pin_cores:
        extra["rank0_cpus"] = pinned
    if shard is not None:
        import thunder_fp8shard

        extra["plan"] = plan_summary(shard)
        extra["pass_module"] = thunder_fp8shard.__file__
    with open(os.path.join(args.workdir, "extra.json"), "w") as f:
        json.dump(extra, f)


# ---- the orchestrator: runs the sides in order and writes the comparison --------------------------------------------


def run_side(side: str, args, flags: list[str]) -> dict:
    workdir = tempfile.mkdtemp(prefix=f"thunder_litgpt_{side}_")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           os.path.abspath(__file__), "--worker", f"--side={side}", f"--workdir={workdir}", f"--options={args.options}"]
    if args.profile_iter is not None:
        cmd.append(f"--profile-iter={args.profile_iter}")
    if args.pin_cores:
        cmd.append("--pin-cores")
    cmd += ["--", *flags]
    path = [*args.pythonpath, ROOT, os.environ.get("PYTHONPATH")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, path)))
    print(f"[thunder_litgpt] {side}: {' '.join(cmd)}", flush=True)
    start, gpus_before = time.perf_counter(), _gpu_state()
    proc = subprocess.run(cmd, env=env, timeout=args.timeout)
    run = {"side": side, "command": cmd, "returncode": proc.returncode, "wall_s": time.perf_counter() - start,
           "gpu_state_before": gpus_before, "gpu_state_after": _gpu_state()}
    if proc.returncode != 0:
        raise RuntimeError(f"the {side} run failed with exit code {proc.returncode}")
    with open(os.path.join(workdir, "metrics.json")) as f:
        run["perf_metrics"] = json.load(f)
    with open(os.path.join(workdir, "extra.json")) as f:
        run.update(json.load(f))
    timed = run["iteration_ms"][-(args_iters(flags)):]
    run["median_timed_iteration_ms"] = statistics.median(timed) if timed else None
    trace = os.path.join(workdir, "trace_rank0.json")
    if os.path.exists(trace):
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from time_profile import load, summarize

        run["profile"] = summarize(load(trace))
        if args.trace_dir:
            os.makedirs(args.trace_dir, exist_ok=True)
            dest = os.path.join(args.trace_dir, f"{args.tag}_{side}{len(os.listdir(args.trace_dir))}.json.gz")
            with open(trace, "rb") as src, gzip.open(dest, "wb") as dst:
                shutil.copyfileobj(src, dst)
            run["trace_file"] = os.path.basename(dest)
    shutil.rmtree(workdir, ignore_errors=True)
    print(f"[thunder_litgpt] {side}: average iter time {run['perf_metrics']['average_iter_time']:.2f} ms, "
          f"memory used {run['perf_metrics']['memory_used_GB']:.2f} GB", flush=True)
    return run


def compare(runs: list[dict]) -> dict:
    """Medians of each side and the overhead; the memory reduction against (k-1)/k of the sharded FP8 bytes (k: the
    ranks each copy is sharded over, N unless shard_group_size says otherwise)."""
    med = {side: {k: statistics.median(r["perf_metrics"][k] for r in runs if r["side"] == side)
                  for k in ("average_iter_time", "memory_used_GB")}
           for side in ("without", "with") if any(r["side"] == side for r in runs)}
    out = {"median": med}
    if len(med) == 2:
        w, wo = med["with"], med["without"]
        out["overhead_pct"] = 100 * (w["average_iter_time"] / wo["average_iter_time"] - 1)
        out["memory_reduction_GB"] = wo["memory_used_GB"] - w["memory_used_GB"]
        plan = next(r["plan"] for r in runs if r["side"] == "with")
        n = plan.get("shard_group_size") or plan["world_size"]
        for key in ("fp8_weight_bytes", "sharded_bytes"):
            ideal = (n - 1) / n * plan[key] / 1e9
            out[f"ideal_reduction_GB_{key}"] = ideal
            out[f"reduction_share_of_{key}"] = out["memory_reduction_GB"] / ideal if ideal else None
    return out


def main() -> None:
    own, flags = split_argv(sys.argv[1:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--order", default="without,with", help="comma-separated sides, run in this order")
    p.add_argument("--nproc", type=int, default=2, help="ranks (one GPU each)")
    p.add_argument("--options", default="{}", help="ShardIntermediates options as JSON")
    p.add_argument("--profile-iter", type=int, default=None, help="profile this iteration (before the timed window)")
    p.add_argument("--trace-dir", default=None, help="where to keep the gzipped Chrome traces of rank 0")
    p.add_argument("--tag", default="run", help="prefix of the trace files")
    p.add_argument("--out", help="the comparison JSON")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="no run: join these comparisons (same flags, options and world size; runs in the order given) "
                        "into --out, e.g. the halves of an interleaved comparison made in two launches")
    p.add_argument("--timeout", type=float, default=None, help="seconds per run")
    p.add_argument("--pythonpath", action="append", default=[],
                   help="put this folder first on the runs' PYTHONPATH (e.g. an older version of the pass)")
    p.add_argument("--pin-cores", action="store_true",
                   help="pin each rank to its own physical cores (both sides alike): a CPU-bound step's time then "
                        "depends less on where the scheduler puts the ranks")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--side", choices=["with", "without"], help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    args = p.parse_args(own)
    json.loads(args.options)  # fail early on bad JSON
    if args.worker:
        return worker(args, flags)
    if args.merge:
        return merge(args.merge, args.out)

    order = [s.strip() for s in args.order.split(",") if s.strip()]
    if not order or set(order) - {"with", "without"}:
        p.error(f"--order takes 'with' and 'without', got {args.order!r}")
    result = {
        "harness": "thunder/benchmarks/benchmark_litgpt.py (installed, unmodified; transform appended at run time)",
        "flags": flags, "options": json.loads(args.options), "order": [], "world_size": args.nproc,
        "n_layers": None if flag(flags, "n_layers") is None else int(flag(flags, "n_layers")),
        "device": _device(), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "pythonpath": args.pythonpath, "runs": [],
    }
    for side in order:
        result["order"].append(side)
        result["runs"].append(run_side(side, args, flags))
        result.update({s: [r["perf_metrics"] for r in result["runs"] if r["side"] == s] for s in ("without", "with")})
        result["summary"] = compare(result["runs"])
        if args.out:  # written after every run: a later failure keeps what was measured
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    print(json.dumps(result["summary"], indent=1))


def merge(paths: list[str], out: str | None) -> None:
    parts = []
    for path in paths:
        with open(path) as f:
            parts.append(json.load(f))
    key = lambda r: (r["flags"], r["options"], r["world_size"], r["device"])  # noqa: E731
    if any(key(r) != key(parts[0]) for r in parts):
        raise SystemExit("--merge: the comparisons differ in flags, options, world size or device")
    result = dict(parts[0], runs=[run for r in parts for run in r["runs"]], order=[s for r in parts for s in r["order"]],
                  merged_from=[os.path.basename(p) for p in paths])
    result.update({s: [r["perf_metrics"] for r in result["runs"] if r["side"] == s] for s in ("without", "with")})
    result["summary"] = compare(result["runs"])
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result["summary"], indent=1))


def args_iters(flags: list[str]) -> int:
    """How many iterations Thunder's benchmark times (max_iters - warmup_iters, its defaults 45 and 25)."""
    return int(flag(flags, "max_iters", 45)) - int(flag(flags, "warmup_iters", 25))


def _gpu_state() -> str:
    """Clocks, temperature, power and active throttle reasons of every GPU (run-to-run drift shows up here)."""
    state = nvidia_smi("index,clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_throttle_reasons.active,memory.used")
    return "unknown" if state is None else state


def _device() -> str:
    """Every GPU's name and driver, one line each."""
    gpus = nvidia_smi("name,driver_version")
    return "unknown" if gpus is None else gpus


if __name__ == "__main__":
    main()
