"""What the memory buys: each side's fastest configuration under a per-GPU memory cap, in tokens/s.

For a cap, each side (without the pass, and with ``ShardIntermediates()``, no options) gets the fastest configuration
of Thunder's benchmark that fits: micro-batch 1, 2 or 4, activation checkpointing off or on. Simulated ranks
(``--simulate N``: rank 0 of N in torch's fake process group, as ``paired.py``): memory is rank 0's exactly, time
has no communication in it.

``search`` runs one worker process a configuration (setup x micro-batch x checkpointing), ``--parallel`` at once on one
GPU. A worker compiles the model once without running it (Thunder's ``_get_computation_and_inputs``), makes the
pass's program of it (:mod:`benchlib.shared_compile`, before any step, as a user's first call compiles it), and
reads both sides' predicted peaks from a second plan with the optimizer's state counted (``optimizer_states=2``,
AdamW's, only for the prediction). A side is run only under the caps its predicted peak fits (the pruning); it runs
under the smallest, ``--steps`` steps with ``torch.cuda.set_per_process_memory_fraction`` at the cap, so that going
over is a real out-of-memory (a side that fits a cap fits every larger one: the allocator's limit only grows); an
out-of-memory there moves it to the next cap. The runs take turns on the GPU (a lock, and room on the device for the
run: the workers share one card, each capped), the pass's side first, so that its first step is the model's first,
as a user's (its calibration then reads the optimizer's state made after it). A micro-batch is compiled only where the
next smaller one is predicted to fit some cap on some side (the predicted peak grows with the micro-batch). One JSON a
configuration under ``--out`` (written as it goes; a search skips those done, so it resumes across sittings) and
``search.json`` (the wall time, the runs made and pruned).

``rows`` picks each side's winner for every cap and setup: the configuration with the most tokens a second in its
confirming runs (the mean of both sides': one ranking for the two; each run alone on the GPU, while other workers
compile: a ranking, not evidence of speed) among those that side ran under a cap at most this one with no
out-of-memory. Tokens a step: micro-batch x sequence x N. The winners' tokens/s
ratio comes from ``paired.py`` (both in one process, alternating, with a CI and a null; ``--arms`` with ``"flags"``,
printed by ``rows --commands``). It writes the JSON (``"kind": "capacity"``, ``"rows"``) that ``results_tables.py``
renders into the README and docs/capacity.md.

Usage (one GPU; a search can outlast a call: run it in the background and collect its folder)::

    python3 benchmarks/capacity.py search --simulate 8 --out /tmp/capacity --parallel 8
    python3 benchmarks/capacity.py rows --search benchmarks/results/<sitting>/capacity \\
        --paired benchmarks/results/<sitting>/paired [...] --out benchmarks/results/capacity.json [--commands]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gc
import itertools
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass

from benchlib import ROOT

SETUPS = {  # name -> (sequence length, its flags)
    "fp8_s4096": (4096, ("--low_precision_mode=fp8-default-te",)),
    "fp8_s8192": (8192, ("--low_precision_mode=fp8-default-te", "--block_size=8192")),
    "bf16_s4096": (4096, ()),
}
COMMON = ("--distributed_mode=fsdp", "--shard_mode=zero3", "--model_name=Llama-2-7b-hf",
          "--compile=thunder_inductor_cat")  # Thunder's benchmark flags, as every launch of this repo's
CAPS_GB = (40, 48, 80)
MICRO_BATCHES = (1, 2, 4)
SIDES = ("with", "without")  # the order a worker runs them in (the pass's first step is the model's first)
OPTIMIZER_STATES = 2  # AdamW's, Thunder's benchmark's optimizer: counted in the predictions only
EXPANDABLE = "expandable_segments:True"  # PYTORCH_CUDA_ALLOC_CONF of an "_xs" configuration (see compile_it)


@dataclass(frozen=True)
class Config:
    setup: str
    micro_batch: int
    checkpointing: bool
    expandable: bool = False  # the caching allocator's expandable segments (PYTORCH_CUDA_ALLOC_CONF), both sides

    @property
    def name(self) -> str:
        return f"{self.setup}_mb{self.micro_batch}_{'ckpt' if self.checkpointing else 'full'}" + (
            "_xs" if self.expandable else "")

    @property
    def twin(self) -> Config:
        """The same configuration under the default allocator."""
        return Config(self.setup, self.micro_batch, self.checkpointing)

    @property
    def env(self) -> dict[str, str]:
        """The environment its process needs (set before CUDA starts)."""
        return {"PYTORCH_CUDA_ALLOC_CONF": EXPANDABLE} if self.expandable else {}

    @property
    def seq(self) -> int:
        return SETUPS[self.setup][0]

    def flags(self, layers: int) -> list[str]:
        """Thunder's benchmark flags of this configuration."""
        return [*COMMON, *SETUPS[self.setup][1], f"--micro_batch_size={self.micro_batch}",
                f"--checkpoint_activations={str(self.checkpointing).lower()}", f"--n_layers={layers}"]

    def tokens_per_step(self, world_size: int) -> int:
        return self.micro_batch * self.seq * world_size

    @classmethod
    def parse(cls, name: str) -> Config:
        setup, mb, ckpt, xs = re.fullmatch(r"(.+)_mb(\d+)_(ckpt|full)(_xs)?", name).groups()
        return cls(setup, int(mb), ckpt == "ckpt", bool(xs))


# ---- the search's rules (pure; tested on the CPU) ---------------------------------------------------------------------


def caps_to_try(predicted_bytes: int | None, caps_gb) -> list[int]:
    """The caps a side is run under, smallest first: those its predicted peak fits (None: not predicted, all)."""
    return sorted(c for c in caps_gb if predicted_bytes is None or predicted_bytes <= c * 1e9)


def fragmented(record: dict, side: str, caps_gb) -> list[int]:
    """The caps a side ran out of memory under although its predicted peak fits them: the allocator's reserved bytes
    (its fragmentation), not the allocated, ran out (s33-s34: 2 to 9 GB over the allocated peak)."""
    fits = caps_to_try(record.get("predicted_peak_bytes", {}).get(side), caps_gb)
    return sorted(r["cap_gb"] for r in record.get("runs", []) if r["side"] == side and not r["fits"]
                  and r.get("oom_of_the_cap") and r["cap_gb"] in fits)


def compile_it(config: Config, records: dict[str, dict], micro_batches, caps_gb) -> bool | None:
    """Whether to compile ``config``: True; False where the next smaller micro-batch of its setup and checkpointing
    is predicted over the largest cap on both sides (a larger micro-batch only holds more); None: not known yet.
    An expandable-segments configuration (``_xs``) only where its twin under the default allocator is done and a side
    of it ran out of memory under a cap its prediction fits (:func:`fragmented`)."""
    if config.expandable:
        twin = records.get(config.twin.name)
        if twin is None or twin.get("status") not in ("done", "skipped", "failed"):
            return None
        return any(fragmented(twin, side, caps_gb) for side in SIDES)
    smaller = [m for m in micro_batches if m < config.micro_batch]
    if not smaller:
        return True
    prev = records.get(Config(config.setup, max(smaller), config.checkpointing).name)
    if prev is None or prev.get("status") == "failed":
        return None if prev is None else True
    if prev.get("status") == "skipped":
        return False
    if "predicted_peak_bytes" not in prev:
        return None
    return any(caps_to_try(p, caps_gb) for p in prev["predicted_peak_bytes"].values())


def oom_of_the_cap(message: str) -> bool:
    """Whether a CUDA out-of-memory was the process's cap (the device had the bytes free), not the device's."""
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
    asked = re.search(r"Tried to allocate ([\d.]+) (\w+)", message)
    free = re.search(r"of which ([\d.]+) (\w+) is free", message)
    if not (asked and free):
        return True
    return float(free[1]) * units[free[2]] >= float(asked[1]) * units[asked[2]]


def caps_of_the_side(record: dict, twin: dict | None, side: str, caps_gb) -> list[int]:
    """The caps a side runs under, smallest first: those its prediction fits, and for an ``_xs`` configuration only
    those its twin ran out of memory under (:func:`fragmented`; none where the twin's side fitted everywhere)."""
    caps = caps_to_try(record["predicted_peak_bytes"][side], caps_gb)
    if twin is None:
        return caps
    ran_out = fragmented(twin, side, caps_gb)
    return [c for c in caps if c in ran_out]


def fitted(record: dict, side: str) -> dict | None:
    """A side's confirming run: the first that ran every step with no out-of-memory (None: none did)."""
    return next((r for r in record.get("runs", []) if r["side"] == side and r["fits"]), None)


def speed(record: dict) -> float | None:
    """A configuration's tokens a second for the ranking: the mean of its sides' confirming runs (one ranking for
    both sides, so that a side's winner differs from the other's only where it fits and the other does not, never
    by the runs' noise, which exceeds the pass's cost; None: no side ran)."""
    runs = [run["tokens_per_s"] for side in SIDES if (run := fitted(record, side)) is not None]
    return sum(runs) / len(runs) if runs else None


def winners(records: dict[str, dict], setup: str, cap_gb: int) -> dict[str, tuple[Config, dict] | None]:
    """Each side's fastest configuration of ``setup`` (:func:`speed`) that ran under a cap at most ``cap_gb`` with no
    out-of-memory, and that side's run."""
    out = {}
    for side in SIDES:
        fits = [(Config.parse(name), run, speed(r)) for name, r in records.items()
                if Config.parse(name).setup == setup and (run := fitted(r, side)) is not None
                and (run["cap_gb"] or 0) <= cap_gb]  # no cap: a run on the CPU
        best = max(fits, key=lambda crs: crs[2], default=None)
        out[side] = None if best is None else best[:2]
    return out


def pruned_runs(records: dict[str, dict], caps_gb) -> int:
    """Runs the predictions saved: for every side of a compiled configuration, the caps its predicted peak is over
    (a search without predictions tries each, smallest first, until one fits); for a configuration not compiled,
    every cap of both sides."""
    n = 0
    for r in records.values():
        if r.get("status") == "skipped":
            n += len(SIDES) * len(caps_gb)
        for p in r.get("predicted_peak_bytes", {}).values():
            n += len(caps_gb) - len(caps_to_try(p, caps_gb))
    return n


# ---- a worker: one configuration, on the device ----------------------------------------------------------------------


def _write(path: str, record: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1)
    os.replace(path + ".tmp", path)


def _compile_only(thunder, bench, batch) -> None:
    """The model's program for ``batch`` compiled as its first call would, without running it."""
    with bench.low_precision_handler.maybe_apply_te_autocast():
        thunder.compile_data(bench.model)._get_computation_and_inputs(batch[0].to(bench.device))


@contextlib.contextmanager
def gpu_turn(torch, dev, lock: str, need: int, cores=None, timeout_s: float = 1800):
    """The GPU to this run alone (``lock``) once the device has ``need`` bytes free for it (other workers hold their
    models meanwhile), on ``cores`` (CPUs no worker compiles on: the step's forward is CPU-bound); yields the seconds
    waited."""
    start = time.perf_counter()
    with open(lock, "a") as f:
        while True:
            fcntl.flock(f, fcntl.LOCK_EX)
            gc.collect()
            torch.cuda.empty_cache()
            if torch.cuda.mem_get_info(dev)[0] + torch.cuda.memory_reserved(dev) >= need or (
                    time.perf_counter() - start > timeout_s):
                break
            fcntl.flock(f, fcntl.LOCK_UN)
            time.sleep(3)
        mine = os.sched_getaffinity(0)
        if cores:
            os.sched_setaffinity(0, cores)
        try:
            yield time.perf_counter() - start
        finally:
            os.sched_setaffinity(0, mine)
            fcntl.flock(f, fcntl.LOCK_UN)


def capped_run(torch, bench, steps: int, drawn: list, cap_gb: int | None) -> dict:
    """``steps`` training steps under ``cap_gb`` (the allocator's limit; None: none): each step's seconds, the peak
    allocated and reserved bytes, the allocator's retries, and the out-of-memory that ended it, if one did."""
    from benchlib.steps import step

    dev, cuda = bench.device, bench.device.type == "cuda"
    if cuda:
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gb * 1e9 / total) if cap_gb else 1.0, dev)
        torch.cuda.reset_peak_memory_stats(dev)
        retries = torch.cuda.memory_stats(dev).get("num_alloc_retries", 0)
    seconds, oom = [], None
    try:
        for i in range(steps):
            t = time.perf_counter()
            step(bench, drawn[i % len(drawn)])  # ends with loss.item(): the device's work is done
            seconds.append(time.perf_counter() - t)
    except torch.OutOfMemoryError as e:
        oom = str(e)[:800]
    finally:
        bench.optimizer.zero_grad(set_to_none=True)
        gc.collect()
    out = {"cap_gb": cap_gb, "steps": len(seconds), "step_s": seconds, "oom": oom,
           "oom_of_the_cap": None if oom is None else oom_of_the_cap(oom)}
    if cuda:
        out.update(peak_bytes=torch.cuda.max_memory_allocated(dev), reserved_peak_bytes=torch.cuda.max_memory_reserved(
            dev), alloc_retries=torch.cuda.memory_stats(dev).get("num_alloc_retries", 0) - retries)
        # the allocator kept to the cap (checked, not assumed, under expandable segments too)
        out["cap_honored"] = cap_gb is None or out["reserved_peak_bytes"] <= cap_gb * 1e9
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
        torch.cuda.empty_cache()
    return out


def worker(args) -> None:
    """One configuration: compile, predict, and run each side under the caps its prediction fits."""
    from benchlib.patches import on_the_cpu, simulate

    config = Config.parse(args.config)
    path = os.path.join(args.out, f"{config.name}.json")
    flags = config.flags(args.layers) + list(args.extra_flags)
    if args.simulate:
        simulate(args.simulate)
    if args.device == "cpu":
        on_the_cpu()
    import torch
    import torch.distributed as dist
    import thunder
    import thunder.benchmarks.benchmark_litgpt as bl

    from benchlib import shared_compile
    from benchlib.reporting import device_name
    from benchlib.steps import batches, kwargs_of
    from thunder_fp8shard import ShardIntermediates

    if args.device == "cpu":
        bl.device = torch.device("cpu")
    torch.set_float32_matmul_precision("high")  # as the benchmark's __main__
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    before = json.load(open(path)) if os.path.exists(path) else {}  # an earlier sitting's: its confirmed sides stand
    kept = [r for r in before.get("runs", []) if fitted(before, r["side"]) is not None]
    record = {"kind": "capacity_config", "config": config.name, "setup": config.setup, "seq": config.seq,
              "micro_batch": config.micro_batch, "checkpointing": config.checkpointing, "flags": flags,
              "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
              "simulated": bool(args.simulate), "world_size": world_size, "device": device_name(),
              "tokens_per_step": config.tokens_per_step(world_size), "status": "compiling", "runs": kept}
    _write(path, record)
    if args.compile_cores:
        os.sched_setaffinity(0, args.compile_cores)
    busy = os.path.join(args.busy, config.name) if args.busy else None
    if busy:
        open(busy, "w").close()
    try:
        t = time.perf_counter()
        bench = bl.Benchmark_litGPT(**kwargs_of(flags))
        bench.train_data_iter = bench.train_dataloader = None  # batches are drawn here (steps.batches)
        drawn = batches(bench, 0)
        _compile_only(thunder, bench, drawn[0])
        base = shared_compile.entries(bench.model)
        predict, shard = ShardIntermediates(optimizer_states=OPTIMIZER_STATES), ShardIntermediates()
        shared_compile.programs(bench.model, base, predict)  # read for its predicted peaks alone
        with_pass, _ = shared_compile.programs(bench.model, base, shard)  # the user's: no options
        if busy:
            os.remove(busy)
            busy = None
        p, q = predict.plans[-1], shard.plans[-1]
        record.update(
            status="compiled", compile_s=time.perf_counter() - t,
            predicted_peak_bytes={"with": p.peak_bytes_after, "without": p.peak_bytes_before},
            predicted_peak_bytes_no_options={"with": q.peak_bytes_after, "without": q.peak_bytes_before},
            same_choice=[d.name for d in p.sharded] == [d.name for d in q.sharded],
            sharded=len(q.sharded), shard_ops=len({b.shard_op for b in q.buckets}))
        _write(path, record)
        cuda = bench.device.type == "cuda"
        twin = json.load(open(os.path.join(args.out, f"{config.twin.name}.json"))) if config.expandable else None
        for side in [s for s in SIDES if fitted(record, s) is None]:
            entries = with_pass if side == "with" else base
            tries, retried = caps_of_the_side(record, twin, side, args.caps) if cuda else [None], False
            while tries:
                cap = tries[0]
                need = min(cap * 1e9, record["predicted_peak_bytes"][side] * 1.02 + 1.5e9) if cuda else 0
                turn = gpu_turn(torch, bench.device, args.lock, need, args.run_cores) if cuda else (
                    contextlib.nullcontext(0.0))
                with turn as waited:
                    beside = len(os.listdir(args.busy)) if args.busy else None  # workers compiling meanwhile
                    shared_compile.activate(bench.model, entries)
                    run = capped_run(torch, bench, args.steps, drawn, cap)
                run.update(side=side, waited_s=waited, compiling_beside=beside,
                           recompiled=len(shared_compile.entries(bench.model)) > len(entries))
                # the device's own out-of-memory (other workers' bytes) says nothing of the cap: once more, later
                again = run["oom"] is not None and not run["oom_of_the_cap"] and not retried
                tries, retried = tries if again else tries[1:], retried or again
                timed = run["step_s"][2:]  # the first two: the program's first call and the optimizer's first step
                run["fits"] = run["oom"] is None and run["steps"] == args.steps and run.get("cap_honored", True)
                run["tokens_per_s"] = record["tokens_per_step"] / sorted(timed)[len(timed) // 2] if timed else None
                record["runs"].append(run)
                _write(path, record)
                if run["fits"]:
                    break
        if shard.reports:
            report = shard.reports[-1]
            record["describe"] = shard.describe()
            record["calibration"] = None if report.calibration is None else {
                **vars(report.calibration), "capacity_bytes": report.calibration.capacity_bytes}
        record["status"] = "done"
    except Exception as e:  # the record says why; the search goes on with the other configurations
        import traceback

        record.update(status="failed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])
    if busy:
        os.remove(busy)
    _write(path, record)


# ---- the search: workers over the configurations ---------------------------------------------------------------------


def search(args) -> None:
    os.makedirs(args.out, exist_ok=True)
    summary_path = os.path.join(args.out, "search.json")
    summary = json.load(open(summary_path)) if os.path.exists(summary_path) else {"sittings": []}
    sitting = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "launched": [], "skipped": []}
    summary["sittings"].append(sitting)
    configs = [Config(s, mb, ck, xs) for xs in args.expandable for s in args.setups for ck in (True, False)
               for mb in args.micro_batches]
    records = lambda: {c.name: json.load(open(p)) for c in configs  # noqa: E731
                       if os.path.exists(p := os.path.join(args.out, f"{c.name}.json"))}
    todo = [c for c in configs if records().get(c.name, {}).get("status") not in ("done", "skipped")]
    running: dict[str, subprocess.Popen] = {}
    start = time.perf_counter()
    busy = os.path.join(args.out, "compiling")
    os.makedirs(busy, exist_ok=True)
    cpus = sorted(os.sched_getaffinity(0))
    run_cores, compile_cores = cpus[:args.run_cores], cpus[args.run_cores:] or cpus  # the runs' own CPUs
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               TORCHINDUCTOR_COMPILE_THREADS=str(args.compile_threads))
    while todo or running:
        for name, proc in list(running.items()):
            if proc.poll() is not None:
                del running[name]
        now = records()
        for c in list(todo):
            go = compile_it(c, now, args.micro_batches, args.caps)
            if go is False and c.expandable:  # its twin needs no other allocator: nothing to record, nothing pruned
                todo.remove(c)
            elif go is False:
                _write(os.path.join(args.out, f"{c.name}.json"), {"kind": "capacity_config", "config": c.name,
                       "status": "skipped", "why": "the next smaller micro-batch is predicted over every cap on both "
                                                   "sides", "runs": []})
                sitting["skipped"].append(c.name)
                todo.remove(c)
            elif go and len(running) < args.parallel:
                log = open(os.path.join(args.out, f"{c.name}.log"), "a")
                cmd = [sys.executable, os.path.abspath(__file__), "worker", f"--config={c.name}", f"--out={args.out}",
                       f"--layers={args.layers}", f"--simulate={args.simulate}", f"--steps={args.steps}",
                       f"--device={args.device}", f"--lock={os.path.join(args.out, 'gpu.lock')}",
                       f"--caps={','.join(map(str, args.caps))}", f"--busy={busy}",
                       f"--run-cores={','.join(map(str, run_cores))}",
                       f"--compile-cores={','.join(map(str, compile_cores))}", "--", *args.extra_flags]
                running[c.name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**env, **c.env})
                sitting["launched"].append(c.name)
                todo.remove(c)
        sitting["wall_s"] = time.perf_counter() - start
        now = records()
        sitting["runs_made"] = sum(len(r.get("runs", [])) for r in now.values())
        sitting["runs_pruned"] = pruned_runs(now, args.caps)
        _write(summary_path, summary)
        print(f"[capacity] {sitting['wall_s']:.0f} s: running {sorted(running)}, to do {[c.name for c in todo]}, "
              f"{sitting['runs_made']} runs made, {sitting['runs_pruned']} pruned", flush=True)
        time.sleep(10)


# ---- the rows: the winners, their timing, the JSON -------------------------------------------------------------------


def rows(search_dir: str, paired_dirs, caps_gb) -> list[dict]:
    """One row a cap and setup (see the module docstring); the tokens/s ratio and its CI from the paired run of the
    two winners where one of ``paired_dirs`` (folders, None: none) has it (:func:`timing_of`)."""
    records = {r["config"]: r for f in sorted(os.listdir(search_dir)) if f.endswith(".json") and f != "search.json"
               for r in [json.load(open(os.path.join(search_dir, f)))]}
    out = []
    for setup, cap in itertools.product(SETUPS, caps_gb):
        if not any(Config.parse(n).setup == setup for n in records):
            continue
        won = winners(records, setup, cap)
        row = {"cap_gb": cap, "setup": setup, "seq": SETUPS[setup][0], "simulated": True}
        for side, w in won.items():
            row[side] = None if w is None else {
                "config": w[0].name, "micro_batch": w[0].micro_batch, "checkpointing": w[0].checkpointing,
                "peak_gb": w[1]["peak_bytes"] / 1e9 if "peak_bytes" in w[1] else None,  # none on the CPU
                "confirmed_under_cap_gb": w[1]["cap_gb"], "steps": w[1]["steps"], "tokens_per_s": w[1]["tokens_per_s"],
                "tokens_per_s_from": "confirming run"}
        row["same_configuration"] = None not in won.values() and won["with"][0] == won["without"][0]
        row["tokens_per_s_ratio"], row["ci95"] = None, None
        flags = None not in won.values() and (records[won["with"][0].name].get("flags") or won["with"][0].flags(32))
        paired = flags and next(filter(None, (timing_of(row, d, flags) for d in paired_dirs or ())), None)
        if paired:
            p = json.load(open(paired))
            for side, key in (("without", "base"), ("with", "arm")):
                if row[side] is not None:
                    row[side].update(tokens_per_s=p["tokens_per_s"][key], tokens_per_s_from="paired")
            null = paired[:-len(f"_{p.get('arm', 'with')}.json")] + "_null.json"
            row.update(tokens_per_s_ratio=p["tokens_per_s_ratio"]["median"], ci95=p["tokens_per_s_ratio"]["ci95"],
                       paired_file=os.path.basename(paired), paired_device=p.get("device"),
                       null_overhead_ci95=json.load(open(null))["overhead_pct"]["ci95"] if os.path.exists(null)
                       else None)
        out.append(row)
    return out


def _normal(flags) -> dict[str, str]:
    """Thunder's benchmark flags as a dict, the defaults this search leaves out spelled in (to compare launches)."""
    out = {"checkpoint_activations": "false", "low_precision_mode": "none", "block_size": "4096"}
    out.update(f[2:].split("=", 1) for f in flags if f.startswith("--") and "=" in f)
    return {k: v.lower() for k, v in out.items()}


def timing_of(row: dict, paired_dir: str, flags: list[str]) -> str | None:
    """The paired JSON that times a row's winners: the pair's own (``<pair>_with.json``, :func:`pair_name`), or, for
    one configuration, any launch of this folder whose base runs its flags and whose arm is the pass with no options
    (``{}``, as issue #62's launches time the FP8 and bf16 defaults; ``--one-model`` records ``optimizer_states`` 0
    for it), with tokens/s (launches since s34); the null is the launch's own."""
    own = os.path.join(paired_dir, f"{pair_name(row)}_with.json")
    if os.path.exists(own) or not row["same_configuration"]:
        return own if os.path.exists(own) else None
    want = _normal(flags)
    for f in sorted(os.listdir(paired_dir)):
        if not f.endswith(".json") or "_accuracy_" in f or f.endswith("_null.json"):
            continue
        p = json.load(open(os.path.join(paired_dir, f)))
        arm = next((a for a in p.get("arms", []) if a["name"] == p.get("arm")), None)
        user = {k: v for k, v in (arm or {}).get("options", {}).items() if k != "optimizer_states"}
        if (p.get("kind") == "paired" and arm and arm.get("options") is not None and user == {}
                and not arm.get("revision") and not arm.get("flags") and p.get("tokens_per_s_ratio")
                and _normal(p.get("flags", [])) == want):
            return os.path.join(paired_dir, f)
    return None


def pair_name(row: dict) -> str:
    """A row's winners, ``<without>__<with>``: the name of their paired run (rows with the same winners share it)."""
    return f"{row['without']['config']}__{row['with']['config']}"


def paired_commands(rows_: list[dict], layers: int, simulate: int, timed: int) -> list[str]:
    """The ``paired.py`` launches that time the rows' winners, each pair once: first the pairs of two
    configurations (where the pass changes the winner), the largest gain their confirming runs rank first, then
    those of one (the pass's own cost)."""
    pairs = {pair_name(r): r for r in rows_ if r["without"] is not None and r["with"] is not None
             and r["tokens_per_s_ratio"] is None}  # not timed yet (``rows --paired``: the folder's timings)
    ordered = sorted(pairs.values(), key=lambda r: (r["same_configuration"],
                                                    -r["with"]["tokens_per_s"] / r["without"]["tokens_per_s"]))
    return [paired_command(r, layers, simulate, timed) for r in ordered]


def paired_command(row: dict, layers: int, simulate: int, timed: int) -> str:
    """The ``paired.py`` launch that times a row's two winners."""
    base, mine = Config.parse(row["without"]["config"]), Config.parse(row["with"]["config"])
    arm = {} if base.flags(layers) == mine.flags(layers) else {"flags": mine.flags(layers)}
    arms = json.dumps({"without": None, "null": None, "with": arm})
    env = "".join(f"{k}={v} " for k, v in {**base.env, **mine.env}.items())  # one process: both arms under it
    return (f"{env}python3 benchmarks/paired.py --simulate {simulate} --timed {timed} --one-model --arms '{arms}' "
            f"--out $R/paired/{pair_name(row)} -- {' '.join(base.flags(layers))}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    ints = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
    for name in ("search", "worker"):
        s = sub.add_parser(name)
        s.add_argument("--out", required=True, help="the folder of the configurations' JSONs")
        s.add_argument("--simulate", type=int, default=8, metavar="N", help="rank 0 of N (0: one real rank)")
        s.add_argument("--layers", type=int, default=32)
        s.add_argument("--steps", type=int, default=12, help="steps a run (the first two are not timed)")
        s.add_argument("--caps", type=ints, default=CAPS_GB, help="GB (1e9 bytes) a GPU, comma-separated")
        s.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    s = sub.choices["search"]
    s.add_argument("--setups", type=lambda v: tuple(v.split(",")), default=tuple(SETUPS))
    s.add_argument("--micro-batches", type=ints, default=MICRO_BATCHES)
    s.add_argument("--expandable", type=lambda v: tuple(x == "on" for x in v.split(",")), default=(False,),
                   help="off,on: also each configuration under expandable segments where the default allocator's "
                        "fragmentation, not its allocated peak, ran out of a cap (compile_it)")
    s.add_argument("--parallel", type=int, default=8, help="workers at once (each compiles on a CPU core)")
    s.add_argument("--compile-threads", type=int, default=2, help="TORCHINDUCTOR_COMPILE_THREADS of a worker")
    s.add_argument("--run-cores", type=int, default=4, help="CPUs kept for the run holding the GPU (no compilation)")
    w = sub.choices["worker"]
    w.add_argument("--config", required=True)
    w.add_argument("--lock", required=True)
    w.add_argument("--busy", default=None, help="the folder of the workers compiling now (one file each)")
    cores = lambda v: set(ints(v)) if v else None  # noqa: E731
    w.add_argument("--run-cores", type=cores, default=None, help="the CPUs a run takes while it holds the GPU")
    w.add_argument("--compile-cores", type=cores, default=None, help="the CPUs a worker compiles on")
    r = sub.add_parser("rows")
    r.add_argument("--search", required=True, help="a search's folder")
    r.add_argument("--paired", nargs="+", default=None, help="the folders of the winners' paired JSONs")
    r.add_argument("--caps", type=ints, default=CAPS_GB)
    r.add_argument("--out", default=None, help="the capacity JSON")
    r.add_argument("--commands", action="store_true", help="print the paired.py launches of the rows' winners")
    args = p.parse_args(argv)
    args.extra_flags = extra
    sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]
    if args.cmd == "search":
        return search(args)
    if args.cmd == "worker":
        return worker(args)
    out = rows(args.search, args.paired, args.caps)
    if args.commands:
        print("\n".join(paired_commands(out, 32, 8, 40)))
        return
    result = {"kind": "capacity", "simulated": True, "rows": out}
    if args.out:
        _write(args.out, result)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
