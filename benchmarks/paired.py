"""The paired benchmark: both sides in one process, their training iterations alternating, the overhead with a CI.

Separate launches of Thunder's harness cannot resolve a 1% cost on these machines (each launch, and each stretch of
one, runs at a speed of its own). Here every side ("arm") is built by Thunder's own ``Benchmark_litGPT`` from the
same flags as ``thunder/benchmarks/benchmark_litgpt.py`` (the pass appended to ``thunder.jit``'s transforms, or to
``ThunderCompiler``'s, while it compiles), in one process, and their iterations alternate in ABBA quads against the
first arm (the base): ``A B B A`` for each further arm in turn, so every iteration of an arm has a base iteration
beside it, and within a quad each side runs once after itself and once after the other. An iteration is the body of
``Benchmark_litGPT.train`` (gradient accumulation 1): the batch to the device, forward under the TE autocast, the
cross-entropy, backward, ``optimizer.step``, ``zero_grad(set_to_none=True)``, ``loss.item()``.

Per iteration it records the wall time, the process's CPU time, the allocator's counters (cudaMalloc and cudaFree
calls, retries), the peak allocated bytes, and Python's garbage collections. The overhead of an arm is the median of
its paired differences (each of its iterations minus the base iteration beside it, in the same quad) as a percentage
of the base's median, with a bootstrap 95% CI over the quads; the CPU time's overhead likewise. An arm without the
pass (``null``) is the A/A check of the instrument: its CI must contain 0.

Ranks: ``--simulate N`` makes this one process rank 0 of N in torch's fake process group (collectives return at once,
so the times have **no communication** in them, and the memory is rank 0's); without it, run under ``torchrun`` with
NCCL, one GPU a rank (every rank runs the same schedule; rank 0 writes).

An arm's options may name a git ``"revision"``: that arm runs that revision's pass (its package extracted with
``git archive`` and imported under another name beside this checkout's), so two versions of the pass are compared in
one process. ``"budget_below_base_bytes": B`` (with ``"policy": "budget"``, on CUDA) sets the arm's ``budget_bytes``
to B under the device peak its step would reach without the pass in this process (:func:`relative_budget`: the
base arm's step peak on top of what is resident when the arm is built); its JSON says whether every timed
iteration's peak met it. ``--device cpu`` runs Thunder's benchmark on the CPU (small litgpt configs, e.g.
``--model_name=pythia-14m --n_layers=2 --block_size=64 --compile=thunder``; with ``--simulate``): the pass's CPU
cost in a whole step, on any machine.

One JSON per comparison (``<out>_<arm>.json``: ``"kind": "paired"``, ``"null"``, ``"overhead_pct"``, ...), and
the log's last lines are a table. Usage (one H200, simulated 8 ranks)::

    python benchmarks/paired.py --simulate 8 --arms '{"without": null, "with": {"optimizer_states": 2}, "null": null}' \\
        --timed 100 --out benchmarks/results/paired_fp8_l32_n8 -- --distributed_mode=fsdp --shard_mode=zero3 \\
        --model_name=Llama-2-7b-hf --micro_batch_size=1 --compile=thunder_inductor_cat \\
        --low_precision_mode=fp8-default-te --n_layers=32

``--timed`` is the number of timed iterations of each non-base arm (the base runs as many for each comparison).
The arms without the pass are built first, so that each compilation of the pass measures the others' resident
memory, which every iteration's peak includes.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import io
import json
import os
import platform
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ---- the schedule and the statistics (pure; tested on the CPU) ------------------------------------------------------


def quad_schedule(n_arms: int, quads_per_arm: int) -> list[tuple[int, int, int]]:
    """``(quad, position, arm)`` for every iteration: for each arm k >= 1 in turn, the quad ``0 k k 0``, then the
    next arm's; ``quads_per_arm`` rounds. Arm 0 is the base."""
    out, q = [], 0
    for _ in range(quads_per_arm):
        for k in range(1, n_arms):
            out += [(q, 0, 0), (q, 1, k), (q, 2, k), (q, 3, 0)]
            q += 1
    return out


def paired_differences(records: list[dict], arm: int, key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The quads of ``arm``, its values minus the base's beside them (``quad_schedule``'s pairs: positions 0-1 and
    2-3), and the base's values in those quads, each as arrays of shape (quads, 2)."""
    by_quad: dict[int, dict[int, float]] = {}
    for r in records:
        by_quad.setdefault(r["quad"], {})[r["position"]] = (r["arm"], r[key])
    quads, diffs, base = [], [], []
    for q, pos in sorted(by_quad.items()):
        if len(pos) != 4 or pos[1][0] != arm:
            continue
        quads.append(q)
        diffs.append([pos[1][1] - pos[0][1], pos[2][1] - pos[3][1]])
        base.append([pos[0][1], pos[3][1]])
    return np.array(quads), np.array(diffs, dtype=float), np.array(base, dtype=float)


def overhead(diffs: np.ndarray, base: np.ndarray, *, resamples: int = 10000, seed: int = 0) -> dict:
    """The median paired difference as a percentage of the base's median, with a bootstrap 95% CI that resamples
    whole quads (the two pairs of a quad share their moment), and the same in the values' own unit."""
    def stat(d, b):
        return 100.0 * np.median(d) / np.median(b)

    rng = np.random.default_rng(seed)
    n = len(diffs)
    idx = rng.integers(0, n, size=(resamples, n))
    d, b = diffs[idx].reshape(resamples, -1), base[idx].reshape(resamples, -1)
    pct = 100.0 * np.median(d, axis=1) / np.median(b, axis=1)
    abs_ = np.median(d, axis=1)
    return {
        "median": float(stat(diffs.ravel(), base.ravel())),
        "ci95": [float(np.percentile(pct, 2.5)), float(np.percentile(pct, 97.5))],
        "median_abs": float(np.median(diffs)), "ci95_abs": [float(np.percentile(abs_, 2.5)),
                                                            float(np.percentile(abs_, 97.5))],
        "base_median": float(np.median(base)), "pairs": int(diffs.size),
    }


def compare(records: list[dict], arm: int) -> dict:
    """Overheads of ``arm`` against the base: wall time and CPU time (%, and ms), peak memory (GB), allocator calls."""
    out = {}
    for key, name in (("wall_ms", "overhead_pct"), ("cpu_ms", "cpu_overhead_pct"), ("issue_ms", "issue_overhead_pct"),
                      ("cpu_issue_ms", "cpu_issue_overhead_pct")):
        _, diffs, base = paired_differences(records, arm, key)
        out[name] = overhead(diffs, base)
    _, dpeak, _ = paired_differences(records, arm, "peak_bytes")
    out["memory_reduction_GB"] = float(-np.median(dpeak) / 1e9)
    for key in ("device_allocs", "alloc_retries"):
        mine = [r[key] for r in records if r["arm"] == arm and r[key] is not None]
        base = [r[key] for r in records if r["arm"] == 0 and r[key] is not None]
        out[f"{key}_per_iteration"] = {"arm": float(np.mean(mine)) if mine else None,
                                      "base": float(np.mean(base)) if base else None}
    return out


# ---- the run (GPU; Thunder's harness) -------------------------------------------------------------------------------


@dataclass
class Arm:
    name: str
    options: dict | None  # ShardIntermediates options; None: no pass
    revision: str | None = None  # a git revision whose pass this arm runs (None: this checkout's)
    bench: object = None  # thunder.benchmarks.benchmark_litgpt.Benchmark_litGPT
    shard: object = None  # the ShardIntermediates instance (with the pass)
    resident_bytes: int = 0  # allocated bytes this arm added while built and warmed up (parameters, optimizer state)
    alone_peak_bytes: int | None = None  # the process's peak while only the arms built so far existed
    before_bytes: int = 0  # allocated bytes when this arm's build began (the arms built before it)
    budget_below_base: int | None = None  # policy "budget": this many bytes under the base's peak (relative_budget)
    which: str = "shard"  # the pass: "shard" (ShardIntermediates) or "compact" (CompactSavedViews: compaction alone)
    build_s: float = 0.0
    first_iteration_s: float = 0.0
    notes: list[str] = field(default_factory=list)


ARM_KEYS = ("revision", "budget_below_base_bytes", "pass")  # an arm's keys that are the benchmark's, not the pass's


def reserve(torch, device, nbytes: int):
    """``nbytes`` of device memory held (a tensor; None for 0): while an arm is built and compiled, the memory the arms
    built after it will hold (estimated as the resident bytes of the arm built before it: the same model, its
    parameters, gradients' leftovers and optimizer state), so that the pass measures, and plans for, the memory
    the timed iterations will run in, where every arm is resident (``--reserve-later``, on by default). A budget
    arm's budget, and every arm's predicted peak, are then those of the timed iterations."""
    if nbytes <= 0:
        return None
    return torch.empty(int(nbytes), dtype=torch.uint8, device=device)


def relative_budget(resident_now: int, base_peak: int, base_before: int, below: int) -> int:
    """``budget_bytes`` for an arm with ``"budget_below_base_bytes": below``: where the base arm's step peaked
    (``base_peak``, over the ``base_before`` bytes resident when it was built) on top of what is resident now
    (``resident_now``: every arm built so far), less ``below``. That is the device bytes this arm's step would peak
    at without the pass, in this process, minus ``below``: what ``max_memory_allocated`` must stay within."""
    if below < 0 or base_peak < base_before:
        raise ValueError(f"budget_below_base_bytes must be >= 0 and the base built first (got {below}, "
                         f"base peak {base_peak} over {base_before})")
    return resident_now + base_peak - base_before - below


OTHER = "thunder_fp8shard_rev"


def import_revision(rev: str, into: str):
    """The pass package of git revision ``rev``, extracted under ``into`` and imported as ``thunder_fp8shard_rev``
    (its imports, executor and operator names renamed, so that both versions coexist in one process)."""
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev, "thunder_fp8shard"], check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            path = os.path.join(into, OTHER, os.path.relpath(member.name, "thunder_fp8shard"))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            text = tar.extractfile(member).read().decode()
            if member.name.endswith(".py"):
                text = re.sub(r"\bthunder_fp8shard\b", OTHER, text).replace('"fp8shard', '"fp8shard_rev')
            with open(path, "w") as f:
                f.write(text)
    sys.path.insert(0, into)
    return importlib.import_module(OTHER)


def _on_the_cpu() -> None:
    """Thunder's benchmark module picks CUDA device ``LOCAL_RANK`` when it is imported, and Thunder FSDP materializes
    on CUDA by default: both go to the CPU instead."""
    import functools

    import thunder.distributed
    import torch

    torch.cuda.set_device = lambda *a, **k: None
    thunder.distributed.fsdp = functools.partial(thunder.distributed.fsdp, device=torch.device("cpu"))


def _simulate(world_size: int) -> None:
    """Rank 0 of ``world_size`` in torch's fake process group: Thunder's benchmark module initializes NCCL when it is
    imported; that call joins the fake group instead."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    os.environ.update(WORLD_SIZE=str(world_size), RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    real = dist.init_process_group

    def fake(*args, **kwargs):
        dist.init_process_group = real
        return real("fake", store=FakeStore(), rank=0, world_size=world_size)

    dist.init_process_group = fake


def _pass_gathers_on_their_own_stream() -> None:
    """``--comm-stream``: the pass's all-gathers keep ProcessGroupNCCL's stream protocol over the fake group.

    The fake group's all-gather copies the input into each of the N chunks of the output on the *current* stream, so
    under ``--simulate`` the pass's gathers (the whole gathered bytes of every bucket, a step) run on the compute stream,
    in a backward that keeps the GPU busy; NCCL runs them on a stream of its own, which first waits for the compute
    stream, and ``wait()`` makes the compute stream wait for it. This does the same around the fake group's call: the
    output is allocated on the compute stream, as the pass does, the copies run on a side stream, and the handle's
    ``wait`` is a stream wait. The bytes the copies write are the gathered buffer's, as NCCL's are. Only the pass's
    operators (``thunder_fp8shard.ops``) are patched; FSDP's own gathers stay on the compute stream on every arm."""
    import torch
    from thunder_fp8shard import ops

    side = torch.cuda.Stream()

    class StreamWork:
        __slots__ = ("event",)

        def __init__(self, event):
            self.event = event

        def wait(self):
            torch.cuda.current_stream().wait_event(self.event)

    def gather_start(shard, offset, nbytes, world_size, group):
        mine = shard if nbytes == shard.numel() else shard[offset : offset + nbytes]
        out = shard.new_empty(nbytes * world_size)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            group._allgather_base(out, mine, ops._ASYNC)
            event = torch.cuda.Event()
            event.record(side)
        out.record_stream(side)
        mine.record_stream(side)
        return ops.GatherHandle(StreamWork(event), out)

    ops._gather_start = gather_start  # the operators fp8shard_gather_start and _gather_next look it up at each call


@contextlib.contextmanager
def _pass_appended(bl, shard):
    """While ``Benchmark_litGPT.setup_compile`` runs: ``thunder.jit`` and ``ThunderCompiler`` get ``shard`` as their
    last transform. Only there: ``thunder.distributed.fsdp`` re-jits afterwards through ``add_transform``, keeping
    the transforms it finds, so the pass is in the list exactly once."""
    import thunder

    if shard is None:
        yield
        return
    setup_compile = bl.Benchmark_litGPT.setup_compile

    def setup_compile_with_pass(self, model):
        real_jit, real_compiler = thunder.jit, bl.ThunderCompiler

        def jit(fn, *a, transforms=None, **kw):
            return real_jit(fn, *a, transforms=[*(transforms or []), shard], **kw)

        def compiler(*a, transforms=None, **kw):
            return real_compiler(*a, transforms=[*(transforms or []), shard], **kw)

        thunder.jit, bl.ThunderCompiler = jit, compiler
        try:
            return setup_compile(self, model)
        finally:
            thunder.jit, bl.ThunderCompiler = real_jit, real_compiler

    bl.Benchmark_litGPT.setup_compile = setup_compile_with_pass
    try:
        yield
    finally:
        bl.Benchmark_litGPT.setup_compile = setup_compile


def _batches(bench, rank: int, n: int = 4) -> list:
    """``n`` batches from Thunder's ``DummyDataset`` (drawn here, not by DataLoader workers; different on each rank),
    on the CPU as the benchmark's loader yields them; the iteration moves one to the device, as ``train`` does."""
    import torch
    import thunder.benchmarks.benchmark_litgpt as bl

    torch.manual_seed(1337 + rank)
    it = iter(bl.DummyDataset(bench.config.block_size, bench.dynamic))
    out = []
    for _ in range(n):
        xs, ys = zip(*[next(it) for _ in range(bench.micro_batch_size)])
        out.append((torch.stack(xs), torch.stack(ys)))
    return out


def step(bench, batch, marks: list | None = None) -> float:
    """One training iteration of ``Benchmark_litGPT.train`` (gradient accumulation 1); returns the loss. ``marks``
    gets ``(wall, cpu)`` clock readings taken right before ``loss.item()``: until then the CPU only enqueues work;
    ``item()`` waits for the device."""
    import torch

    input_ids, targets = batch
    input_ids, targets = input_ids.to(bench.device), targets.to(bench.device)
    with bench.low_precision_handler.maybe_apply_te_autocast():
        logits = bench.model(input_ids)
    if not isinstance(logits, torch.Tensor):
        logits = logits["last_hidden_state"]
    logits = logits.reshape(-1, logits.size(-1))
    targets = targets.reshape(-1)
    loss = torch.nn.functional.cross_entropy(logits, targets, ignore_index=-1) / bench.gradient_accumulation_steps
    loss.backward()
    bench._torchao_fp8_handler.sync_float8_amax_and_scale_history_for_delayed_scaling(bench.model)
    bench.optimizer.step()
    bench.optimizer.zero_grad(set_to_none=True)
    bench._torchao_fp8_handler.precompute_fp8_dynamic_scale_for_fsdp(bench.model)
    if marks is not None:
        marks.append((time.perf_counter(), time.process_time()))
    return loss.item()


class _GcLog:
    """Python's garbage collections: ``(start, generation, seconds)`` each."""

    def __init__(self):
        self.collections: list[tuple[float, int, float]] = []
        self._start = None

    def __call__(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.collections.append((self._start, info["generation"], time.perf_counter() - self._start))
            self._start = None


def _counters(torch, device) -> tuple[int | None, int | None]:
    if device.type != "cuda":
        return None, None
    s = torch.cuda.memory_stats(device)
    return s.get("num_device_alloc"), s.get("num_alloc_retries")


def timed_iteration(torch, arm: Arm, batch, gc_log: _GcLog) -> dict:
    """Runs one iteration of ``arm`` and returns its record."""
    device = arm.bench.device
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    allocs0, retries0 = _counters(torch, device)
    n_gc = len(gc_log.collections)
    marks: list = []
    c0, t0 = time.process_time(), time.perf_counter()
    loss = step(arm.bench, batch, marks)
    t1, c1 = time.perf_counter(), time.process_time()
    (te, ce), = marks
    allocs1, retries1 = _counters(torch, device)
    gcs = gc_log.collections[n_gc:]
    return {
        "wall_ms": (t1 - t0) * 1e3, "cpu_ms": (c1 - c0) * 1e3, "loss": loss,
        # until loss.item(): the CPU's issuing of the step (wall and CPU time); the rest is waiting for the device
        "issue_ms": (te - t0) * 1e3, "cpu_issue_ms": (ce - c0) * 1e3,
        "peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else 0,
        "device_allocs": None if allocs0 is None or allocs1 is None else allocs1 - allocs0,
        "alloc_retries": None if retries0 is None or retries1 is None else retries1 - retries0,
        "gc_ms": sum(s for _, _, s in gcs) * 1e3, "gc_full": any(g == 2 for _, g, _ in gcs),
    }


def build(bl, arm: Arm, kwargs: dict, passes: dict) -> None:
    import torch

    arm.shard = passes[arm.revision, arm.which](**arm.options) if arm.options is not None else None
    start = time.perf_counter()
    with _pass_appended(bl, arm.shard):
        arm.bench = bl.Benchmark_litGPT(**kwargs)
    # the batches are drawn in this process (see _batches): stop the benchmark's DataLoader workers
    arm.bench.train_data_iter = arm.bench.train_dataloader = None
    gc.collect()
    arm.build_s = time.perf_counter() - start
    if arm.shard is not None:
        arm.notes.append(f"the pass is in the model's transforms {_count_pass(arm.bench.model, arm.shard)} time(s)")
    del torch


def _count_pass(model, shard) -> int | None:
    """How often ``shard`` is among the compiled model's transforms (Thunder's jit; None under ThunderFX, which
    compiles later, per subgraph)."""
    import thunder

    try:
        return list(thunder.compile_data(model).transforms).count(shard)
    except Exception:  # not a ThunderModule (ThunderFX): its subgraphs are compiled at the first call
        return None


def profile_arms(torch, arms: list[Arm], batch, trace_dir: str | None, top: int = 40) -> dict:
    """One iteration of each arm under ``torch.profiler`` (CPU + CUDA): the operators with the most self CPU time,
    the pass's own operators, and (with ``trace_dir``) the Chrome trace, gzipped, summarized by
    ``profile_summary.py`` (the compute stream's idle time waiting for the CPU, NCCL kernels per stream)."""
    import gzip
    import shutil

    out = {}
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    for arm in arms:
        step(arm.bench, batch)  # after the other arm's profiled iteration: not profiled
        with torch.profiler.profile(activities=acts) as prof:
            step(arm.bench, batch)
        events = prof.key_averages()
        rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
        row = lambda e: {"name": e.key, "calls": e.count, "self_cpu_us": e.self_cpu_time_total,  # noqa: E731
                         "cpu_total_us": e.cpu_time_total}
        out[arm.name] = {"top_self_cpu": [row(e) for e in rows[:top]],
                         "pass_ops": [row(e) for e in rows if e.key.startswith("fp8shard_")],
                         "self_cpu_total_us": sum(e.self_cpu_time_total for e in rows)}
        print(f"[paired] profile of {arm.name}:\n" + events.table(sort_by="self_cpu_time_total", row_limit=top),
              flush=True)
        if trace_dir:
            from profile_summary import load, summarize

            raw = os.path.join(trace_dir, f"trace_{arm.name}.json")
            prof.export_chrome_trace(raw)
            out[arm.name]["summary"] = summarize(load(raw))
            with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.remove(raw)
    return out


def plan_summary(shard) -> dict | None:
    """The plan of the training compilation (the one with the most decisions), as plain data."""
    if shard is None or not shard.plans:
        return None
    plan = max(shard.plans, key=lambda p: len(p.decisions) + len(getattr(p, "compactions", [])))
    fp8 = [d for d in plan.decisions if d.kind in ("te_float8", "float8")]
    # under ThunderFX one plan a subgraph, and one subgraph can run for several blocks: totals are plan x runs
    trained = [p for p in shard.plans if p.decisions or getattr(p, "compactions", [])]
    runs = [getattr(p, "runs_per_step", None) or 1 for p in trained]
    total = lambda f: sum(f(p) * r for p, r in zip(trained, runs))  # noqa: E731
    return {
        "text": str(plan), "world_size": plan.world_size, "integration": plan.integration,
        "pass_seconds": plan.pass_seconds, "candidates": len(plan.decisions), "sharded": len(plan.sharded),
        "buckets": len(plan.buckets), "shard_ops": len({b.shard_op for b in plan.buckets}),
        "sharded_bytes": total(lambda p: sum(d.nbytes for d in p.sharded)),
        "fp8_weight_bytes": sum(d.nbytes for d in fp8 if d.replicated),
        "plans": len(trained), "runs_per_step": runs,
        "saved_bytes_before": plan.saved_bytes_before, "saved_bytes_after": plan.saved_bytes_after,
        "peak_bytes_before": plan.peak_bytes_before, "peak_bytes_after": plan.peak_bytes_after,
        "peak_step_before": _peak_where(plan.timeline_before), "peak_step_after": _peak_where(plan.timeline_after),
        # getattr: a "revision" arm's plan may predate these
        "gathered_bytes_per_step": total(lambda p: getattr(p, "gathered_bytes_per_step", 0)),
        "saving_fraction": getattr(plan, "saving_fraction", (plan.world_size - 1) / plan.world_size),
        "compactions": total(lambda p: len(getattr(p, "compacted", []))),
        "compacted_bytes": total(lambda p: getattr(p, "compacted_bytes_per_step", 0)),
        "compaction_freed_bytes": total(lambda p: sum(c.freed_bytes for c in getattr(p, "compacted", []))),
        "budget_bytes": getattr(plan, "budget_bytes", None), "budget_target_bytes": getattr(plan, "budget_target_bytes", None),
        "terms": [{"name": t.name, "source": t.source, "bytes": t.nbytes} for t in plan.terms],
        "audit": getattr(plan, "audit", None), "calibration": getattr(plan, "calibration", None),
        "notes": list(plan.notes),
    }


def _peak_where(tl) -> dict | None:
    if tl is None:
        return None
    s = tl.peak_step
    return {"phase": s.phase, "index": s.index, "label": getattr(s, "label", None)}


def _flag(flags: list[str], name: str, default=None):
    return next((f.split("=", 1)[1] for f in flags if f.startswith(f"--{name}=")), default)


def _device_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return platform.processor() or "cpu"


def run(args, flags: list[str]) -> list[dict]:
    if args.simulate:
        _simulate(args.simulate)
    if args.device == "cpu":
        _on_the_cpu()
    import torch
    import torch.distributed as dist
    import thunder.benchmarks.benchmark_litgpt as bl
    from jsonargparse import ArgumentParser

    from thunder_fp8shard import CompactSavedViews, ShardIntermediates
    if args.comm_stream:
        _pass_gathers_on_their_own_stream()

    if args.device == "cpu":
        bl.device = torch.device("cpu")

    parser = ArgumentParser()
    parser.add_class_arguments(bl.Benchmark_litGPT)
    kwargs = parser.parse_args(flags).as_dict()
    torch.set_float32_matmul_precision("high")  # as the benchmark's __main__
    rank = dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    dev = bl.device
    cuda = dev.type == "cuda"
    arms = [Arm(name, None if opts is None else {k: v for k, v in opts.items() if k not in ARM_KEYS},
                None if opts is None else opts.get("revision"),
                budget_below_base=None if opts is None else opts.get("budget_below_base_bytes"),
                which="shard" if opts is None else opts.get("pass", "shard"))
            for name, opts in json.loads(args.arms).items()]
    if any(a.which not in ("shard", "compact") or (a.which == "compact" and a.revision) for a in arms):
        raise SystemExit('--arms: "pass" is "shard" (ShardIntermediates) or "compact" (CompactSavedViews, this '
                         'checkout only)')
    if any(a.budget_below_base is not None for a in arms) and not cuda:
        raise SystemExit("--arms: budget_below_base_bytes needs CUDA (the budget is in device bytes)")
    if len(arms) < 2 or arms[0].options is not None:
        raise SystemExit("--arms: the first arm is the base and has no pass (null), and at least one more arm")
    passes = {(None, "shard"): ShardIntermediates, (None, "compact"): CompactSavedViews}
    revs = {a.revision for a in arms if a.revision is not None}
    if len(revs) > 1:
        raise SystemExit(f"--arms: at most one other revision of the pass in a process, got {sorted(revs)}")
    revisions = tempfile.TemporaryDirectory()  # lives as long as this run
    for rev in revs:
        passes[rev, "shard"] = import_revision(rev, revisions.name).ShardIntermediates
    gc_log = _GcLog()
    gc.callbacks.append(gc_log)
    batches = None
    # build the arms without the pass first (see the module docstring), each compiled and warmed up alone; with
    # --reserve-later, the memory the arms built after it will hold is reserved while each is built (see reserve)
    order = sorted(arms, key=lambda a: a.options is not None)
    placeholder = None
    for j, arm in enumerate(order):
        placeholder = None  # freed: the next reservation is made for the arms after this one
        if cuda and args.reserve_later and j:
            placeholder = reserve(torch, dev, (len(order) - 1 - j) * order[j - 1].resident_bytes)
        before = arm.before_bytes = torch.cuda.memory_allocated(dev) if cuda else 0
        if arm.budget_below_base is not None:
            base = arms[0]
            arm.options = {**arm.options, "budget_bytes": relative_budget(
                before, base.alone_peak_bytes, base.before_bytes, arm.budget_below_base)}
        build(bl, arm, kwargs, passes)
        batches = batches or _batches(arm.bench, rank)
        t = time.perf_counter()
        step(arm.bench, batches[0])  # compiles
        arm.first_iteration_s = time.perf_counter() - t
        if cuda:  # the steady state: the warm-up iterations' peak (the first backward after an optimizer step, too)
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        for k in range(args.warmup):
            step(arm.bench, batches[k % len(batches)])
        if cuda:
            torch.cuda.synchronize(dev)
            arm.alone_peak_bytes = torch.cuda.max_memory_allocated(dev)
            arm.resident_bytes = torch.cuda.memory_allocated(dev) - before
        print(f"[paired] built {arm.name}: {arm.build_s:.1f} s, first iteration {arm.first_iteration_s:.1f} s, "
              f"resident {arm.resident_bytes / 1e9:.2f} GB, peak so far {(arm.alone_peak_bytes or 0) / 1e9:.2f} GB",
              flush=True)
    placeholder = None  # every arm is built: what was reserved for them, they hold
    del placeholder
    schedule = quad_schedule(len(arms), args.warmup_quads) + quad_schedule(len(arms), args.timed // 2)
    n_warm = 4 * (len(arms) - 1) * args.warmup_quads
    gc.collect()
    if args.freeze_gc:
        gc.freeze()  # the compiled programs and traces: long-lived, never garbage; both sides alike
    records = []
    t_start = time.perf_counter()
    for i, (quad, position, k) in enumerate(schedule):
        r = timed_iteration(torch, arms[k], batches[i % len(batches)], gc_log)
        if i >= n_warm:
            records.append(dict(r, quad=quad, position=position, arm=k, t_s=time.perf_counter() - t_start))
    profile = profile_arms(torch, arms, batches[0], args.trace_dir) if args.profile else None
    gc.callbacks.remove(gc_log)
    if rank != 0:
        return []
    common = {
        "kind": "paired", "simulated": bool(args.simulate), "world_size": world_size,
        "communication": ("none (simulated ranks: torch's fake process group)" + (
            "; the pass's all-gathers keep NCCL's stream protocol (--comm-stream): the fake group's copies on a side "
            "stream" if args.comm_stream else "; the fake group's all-gather copies run on the compute stream"))
        if args.simulate else
        f"{dist.get_backend() if dist.is_initialized() else 'none'}, {world_size} ranks",
        "n_layers": int(_flag(flags, "n_layers", 0)) or None, "low_precision_mode": _flag(flags, "low_precision_mode", "none"),
        "model_name": _flag(flags, "model_name"), "flags": flags, "device": _device_name(),
        "launch": " ".join([os.path.basename(sys.executable), *sys.argv]), "started": args.started,
        "design": f"ABBA quads against the base arm, {args.timed} timed iterations per arm ({args.timed // 2} quads), "
                  f"{args.warmup_quads} warm-up quads per arm discarded, bootstrap 95% CI over quads; "
                  f"gc.freeze after warm-up: {args.freeze_gc}",
        "arms": [{"name": a.name, "options": a.options, "revision": a.revision, "build_s": a.build_s, "first_iteration_s": a.first_iteration_s,
                  "resident_GB": a.resident_bytes / 1e9,
                  "alone_peak_GB": None if a.alone_peak_bytes is None else a.alone_peak_bytes / 1e9,
                  "notes": a.notes, "plan": plan_summary(a.shard)} for a in arms],
        "records": records, "profile": profile,
    }
    results = []
    for k, arm in enumerate(arms[1:], start=1):
        res = dict(common, arm=arm.name, base=arms[0].name, options=arm.options, revision=arm.revision,
                   null=arm.options is None,
                   **compare(records, k))
        plan = plan_summary(arm.shard)
        if plan:
            # (k-1)/k of the sharded copies (the shard group's k), and what the compactions free
            sharding = plan["saving_fraction"] * plan["sharded_bytes"] / 1e9
            ideal = sharding + plan["compaction_freed_bytes"] / 1e9
            res["ideal_sharding_reduction_GB"], res["compaction_freed_GB"] = sharding, plan["compaction_freed_bytes"] / 1e9
            res["compacted_bytes"] = plan["compacted_bytes"]
            res["ideal_reduction_GB"] = ideal
            res["reduction_share_of_ideal"] = res["memory_reduction_GB"] / ideal if ideal else None
            res["predicted_peak_GB"] = {"before": plan["peak_bytes_before"] / 1e9, "after": plan["peak_bytes_after"] / 1e9}
            res["measured_peak_GB"] = {
                "base": float(np.median([r["peak_bytes"] for r in records if r["arm"] == 0])) / 1e9,
                "arm": float(np.median([r["peak_bytes"] for r in records if r["arm"] == k])) / 1e9}
            res["gathered_bytes_per_step"] = plan.get("gathered_bytes_per_step")
            if arm.budget_below_base is not None:
                worst = max(r["peak_bytes"] for r in records if r["arm"] == k)
                res["budget"] = {"below_base_bytes": arm.budget_below_base, "budget_bytes": arm.options["budget_bytes"],
                                 "largest_iteration_peak_bytes": worst, "met": worst <= arm.options["budget_bytes"]}
        results.append(res)
    return results


def accuracy_reports(results: list[dict]) -> dict[str, dict]:
    """The plan's predicted peak against the measured one, one report a configuration (``"kind": "plan_accuracy"``):
    each arm with the pass (its plan's peak after, at compilation and as the run-time audit corrected it, against
    the median of its timed iterations' peaks) and the base without it (the first such plan's peak before against
    the base's). With ``--reserve-later`` every prediction is made for the memory the timed iterations run in."""
    out = {}
    for r in results:
        if r.get("null") or "predicted_peak_GB" not in r:
            continue
        arm = next(a for a in r["arms"] if a["name"] == r["arm"])
        common = {k: r[k] for k in ("device", "simulated", "world_size", "n_layers", "low_precision_mode", "flags",
                                    "started", "launch")}
        common["executors"] = _flag(r["flags"], "compile", "thunder")
        plan = arm["plan"]
        if not r["measured_peak_GB"]["base"]:  # the CPU: no device peak
            continue
        for name, with_pass, predicted, measured in (
                (r["arm"], True, plan["peak_bytes_after"], r["measured_peak_GB"]["arm"] * 1e9),
                (r["base"], False, plan["peak_bytes_before"], r["measured_peak_GB"]["base"] * 1e9)):
            if name in out:
                continue
            out[name] = dict(common, kind="plan_accuracy", arm=name, with_pass=with_pass,
                             options=r["options"] if with_pass else None,
                             predicted_peak_bytes=int(predicted), measured_peak_bytes=int(measured),
                             error_pct=100.0 * (predicted - measured) / measured,
                             predicted_from=f"the plan of arm {r['arm']!r}" + (" (its peak after)" if with_pass
                                                                               else " (its peak before: no pass)"),
                             terms=plan["terms"], audit=plan["audit"], calibration=plan["calibration"])
    return out


def _table(results: list[dict]) -> str:
    rows = ["arm vs base | wall overhead % [95% CI] | ms [CI] | CPU issue overhead % [CI] | base median ms | "
            "peak GB reduction"]
    for r in results:
        o, c = r["overhead_pct"], r["cpu_issue_overhead_pct"]
        rows.append(f"{r['arm']} vs {r['base']} | {o['median']:+.2f} [{o['ci95'][0]:+.2f}, {o['ci95'][1]:+.2f}] | "
                    f"{o['median_abs']:+.2f} [{o['ci95_abs'][0]:+.2f}, {o['ci95_abs'][1]:+.2f}] | "
                    f"{c['median']:+.2f} [{c['ci95'][0]:+.2f}, {c['ci95'][1]:+.2f}] | {o['base_median']:.2f} | "
                    f"{r['memory_reduction_GB']:.2f}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arms", default='{"without": null, "with": {}}',
                   help="JSON object: arm name -> ShardIntermediates options, or null for no pass; the first is the base")
    p.add_argument("--simulate", type=int, default=0, metavar="N", help="rank 0 of N in torch's fake process group")
    p.add_argument("--comm-stream", action="store_true",
                   help="with --simulate on CUDA: the pass's all-gathers run as ProcessGroupNCCL runs them, on a "
                        "stream of their own (the fake group otherwise copies on the compute stream)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: Thunder's benchmark on the CPU (small configs; the pass's CPU cost in a whole step)")
    p.add_argument("--timed", type=int, default=100, help="timed iterations per arm (even)")
    p.add_argument("--warmup", type=int, default=2, help="iterations of each arm right after it is compiled")
    p.add_argument("--no-reserve-later", dest="reserve_later", action="store_false",
                   help="do not reserve, while an arm is built, the memory of the arms built after it (see reserve)")
    p.add_argument("--warmup-quads", type=int, default=2, help="alternating quads per arm before timing (discarded)")
    p.add_argument("--no-freeze-gc", dest="freeze_gc", action="store_false",
                   help="do not gc.freeze() the objects alive after warm-up")
    p.add_argument("--profile", action="store_true", help="afterwards, profile one iteration of each arm")
    p.add_argument("--trace-dir", default=None, help="with --profile: where the gzipped Chrome traces go")
    p.add_argument("--out", help="JSON path prefix: one <out>_<arm>.json per comparison")
    args = p.parse_args(own)
    json.loads(args.arms)
    if args.comm_stream and not (args.simulate and args.device == "cuda"):
        p.error("--comm-stream is for simulated ranks on CUDA (--simulate N): NCCL keeps its own stream")
    if args.comm_stream and any("revision" in (o or {}) for o in json.loads(args.arms).values()):
        p.error("--comm-stream patches this checkout's operators only: a \"revision\" arm would keep its gathers on "
                "the compute stream")
    args.started = time.strftime("%Y-%m-%d %H:%M:%S")
    sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]
    results = run(args, flags)
    for r in results:
        if args.out:
            path = f"{args.out}_{r['arm']}.json"
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as f:
                json.dump(r, f, indent=1)
            print(f"[paired] wrote {path}")
    if results and args.out:
        for name, report in accuracy_reports(results).items():
            path = f"{args.out}_accuracy_{name}.json"
            with open(path, "w") as f:
                json.dump(report, f, indent=1)
            print(f"[paired] wrote {path}: predicted {report['predicted_peak_bytes'] / 1e9:.3f} GB, measured "
                  f"{report['measured_peak_bytes'] / 1e9:.3f} GB ({report['error_pct']:+.2f}%)")
    if results:
        print(_table(results), flush=True)


if __name__ == "__main__":
    main()
