"""The measured training step of Thunder's ``Benchmark_litGPT`` (``bench``): its arguments from the flags, its
batches, one iteration as ``train`` runs it, Python's garbage collections, the allocator's counters, one timed
iteration's record, profiled iterations."""

from __future__ import annotations

import os
import time


def kwargs_of(flags: list[str]) -> dict:
    """``Benchmark_litGPT``'s arguments from the benchmark's flags, as its command line parses them."""
    import thunder.benchmarks.benchmark_litgpt as bl
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(bl.Benchmark_litGPT)
    return parser.parse_args(flags).as_dict()


def batches(bench, rank: int, n: int = 4) -> list:
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


class GcLog:
    """Python's garbage collections: ``(start, generation, seconds)`` each (a ``gc.callbacks`` entry). A full
    collection walks every tracked object of the process (Thunder's traces of a 32-layer model are millions), so it
    can stall one iteration of a CPU-bound step; this tells such stalls from the pass's cost."""

    def __init__(self):
        self.collections: list[tuple[float, int, float]] = []
        self._start: float | None = None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.collections.append((self._start, info["generation"], time.perf_counter() - self._start))
            self._start = None


def gc_per_iteration(starts: list[float], collections: list[tuple[float, int, float]]) -> dict:
    """Milliseconds of garbage collection in each iteration (``starts``: the iterations' start times and the end of
    the last), and the full (generation 2) collections' iterations."""
    ms, full = [0.0] * (len(starts) - 1), []
    for at, generation, seconds in collections:
        i = next((k for k in range(len(ms)) if starts[k] <= at < starts[k + 1]), None)
        if i is None:
            continue
        ms[i] += seconds * 1e3
        if generation == 2:
            full.append(i)
    return {"iteration_gc_ms": ms, "full_collection_iterations": full}


def allocator_counters(torch, device) -> tuple[int | None, int | None]:
    """The caching allocator's cudaMalloc calls and retries so far (None, None off CUDA)."""
    if device.type != "cuda":
        return None, None
    s = torch.cuda.memory_stats(device)
    return s.get("num_device_alloc"), s.get("num_alloc_retries")


def timed_iteration(torch, bench, batch, gc_log: GcLog) -> dict:
    """Runs one iteration of ``bench`` and returns its record: wall and CPU time (whole, and until ``loss.item()``),
    the loss, the peak allocated bytes, the allocator's calls and retries, and the garbage collections in it."""
    device = bench.device
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    allocs0, retries0 = allocator_counters(torch, device)
    n_gc = len(gc_log.collections)
    marks: list = []
    c0, t0 = time.process_time(), time.perf_counter()
    loss = step(bench, batch, marks)
    t1, c1 = time.perf_counter(), time.process_time()
    (te, ce), = marks
    allocs1, retries1 = allocator_counters(torch, device)
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


def profile_steps(torch, benches: dict, batch, trace_dir: str | None, top: int = 40, tag: str = "paired",
                  before: dict | None = None) -> dict:
    """One iteration of each of ``benches`` (name -> bench) under ``torch.profiler`` (CPU + CUDA): the operators with
    the most self CPU time, the pass's own operators, and (with ``trace_dir``) the Chrome trace, gzipped, summarized
    by ``time_profile.py step`` (the compute stream's idle time waiting for the CPU, NCCL kernels per stream, the pass's
    operators by kind). ``before``: name -> a function called before each of that bench's iterations (``paired.py
    --one-model``: the arm's programs made the model's)."""
    import gzip
    import shutil

    out = {}
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    for name, bench in benches.items():
        ready = (before or {}).get(name, lambda: None)
        ready()
        step(bench, batch)  # after the other one's profiled iteration: not profiled
        ready()
        with torch.profiler.profile(activities=acts) as prof:
            step(bench, batch)
        events = prof.key_averages()
        rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
        row = lambda e: {"name": e.key, "calls": e.count, "self_cpu_us": e.self_cpu_time_total,  # noqa: E731
                         "cpu_total_us": e.cpu_time_total}
        out[name] = {"top_self_cpu": [row(e) for e in rows[:top]],
                     "pass_ops": [row(e) for e in rows if e.key.startswith("fp8shard_")],
                     "self_cpu_total_us": sum(e.self_cpu_time_total for e in rows)}
        print(f"[{tag}] profile of {name}:\n" + events.table(sort_by="self_cpu_time_total", row_limit=top),
              flush=True)
        if trace_dir:
            from time_profile import load, summarize

            raw = os.path.join(trace_dir, f"trace_{name}.json")
            prof.export_chrome_trace(raw)
            out[name]["summary"] = summarize(load(raw))
            with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.remove(raw)
    return out
