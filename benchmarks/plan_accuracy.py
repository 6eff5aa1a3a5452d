"""Plan accuracy: the pass's predicted per-rank memory of one training step against what the device measured.

Trains a Thunder FSDP ZeRO-3 model (``litgpt_run.setup_rank``: litgpt with TransformerEngine FP8 on the GPU;
``--model toy --no-te --device cpu``: the fake-FP8 ``toy_models.FakeFP8Llama`` on the CPU) for ``--steps`` AdamW
steps and records the last one: on CUDA with ``torch.cuda.memory._record_memory_history`` (the allocator's
alloc/free events, with Python stacks), on the CPU with ``torch.profiler`` (``profile_memory=True``). Small marker
allocations (``MARK_BYTES``, allocated and freed at once) split the recorded events into the step's phases:
forward (the jitted forward), loss (between the forward's return and the moment the output's gradient reaches the
jitted backward: the loss and its backward), backward (the jitted backward) and optimizer (AdamW and
``zero_grad``). Writes a JSON with, per rank: the plan's predicted peak (device model and program alone) and
where (phase, step, operator), the measured ``max_memory_allocated`` and the allocated bytes rebuilt from the
events, where their maximum is reached (phase, position in it, Python frames, the line of Thunder's program and the
plan's step it maps to; on CUDA the rebuilt maximum must equal the allocator's ``requested_bytes`` peak), the terms of the memory model with their sources, and both timelines (downsampled; the
maximum of every bin kept); and a figure of rank 0's predicted and measured timelines on one axis, normalized so
that the phases line up (forward and backward each 1 wide, loss and optimizer 0.15).

Examples::

    # 2 GPUs, NCCL, TE FP8, 8 layers of Llama-2-7b
    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/plan_accuracy.py --backend nccl \\
        --n-layer 8 --seq-len 4096 --sdpa --out benchmarks/results/plan_accuracy_l8.json
    # one H200, rank 0 of 8 simulated ranks (fake process group), 8 layers, every block checkpointed
    python benchmarks/plan_accuracy.py --backend fake --world-size 8 --n-layer 8 --seq-len 4096 \\
        --checkpoint-activations --options '{"candidates": "all"}' --out /tmp/acc_ckpt_all.json
    # CPU, 2 gloo ranks, fake FP8
    python benchmarks/plan_accuracy.py --model toy --no-te --device cpu --n-layer 2 --seq-len 16 --out /tmp/acc.json
"""

from __future__ import annotations

import argparse
import json
import linecache
import os
import re
import sys
import tempfile
from dataclasses import asdict, replace

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [p for p in (HERE, os.path.dirname(HERE)) if p not in sys.path]

from thunder_fp8shard.reporting.plan_text import plan_text  # noqa: E402
from thunder_fp8shard.testing import litgpt_run  # noqa: E402
from thunder_fp8shard.testing.trained import trained  # noqa: E402

MARK_BYTES = 1021 * 512  # a multiple of the CUDA allocator's 512-byte rounding with a prime factor no model has
PHASES = ("forward", "loss", "backward", "optimizer")
WIDTH = {"forward": 1.0, "loss": 0.15, "backward": 1.0, "optimizer": 0.15}
OFFSET = {p: sum(WIDTH[q] for q in PHASES[: PHASES.index(p)]) for p in PHASES}
MAX_POINTS = 4000


# ---- recording: the device's allocation events of one step ----------------------------------------------------------


class CudaRecorder:
    """``torch.cuda.memory._record_memory_history`` around the step; events of this rank's device. The allocator's
    events carry requested sizes, so the baseline is ``requested_bytes.all.current`` and the rebuilt maximum is
    checked against ``requested_bytes.all.peak``; ``max_memory_allocated`` counts blocks (512-byte rounding, unsplit
    remainders) and reads a little higher."""

    def __init__(self, device: torch.device, snapshot_path: str | None = None, max_entries: int = 2_000_000):
        self.device, self.snapshot_path, self.max_entries = device, snapshot_path, max_entries

    def start(self) -> int:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        baseline = torch.cuda.memory_stats(self.device)["requested_bytes.all.current"]
        torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                                 max_entries=self.max_entries)
        return baseline

    def stop(self) -> tuple[list[dict], dict]:
        torch.cuda.synchronize(self.device)
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        stats = torch.cuda.memory_stats(self.device)
        device_stats = {"max_memory_allocated": torch.cuda.max_memory_allocated(self.device),
                        "max_requested_bytes": stats["requested_bytes.all.peak"]}
        if self.snapshot_path:
            import pickle

            with open(self.snapshot_path, "wb") as f:
                pickle.dump(snapshot, f)  # for https://pytorch.org/memory_viz
        return events_from_snapshot(snapshot, self.device.index), device_stats


class CpuRecorder:
    """``torch.profiler`` with ``profile_memory=True``: the CPU allocator's events. The profiler counts bytes from
    its start, so the baseline is estimated: the distinct storages of ``alive`` (parameters, gradients, optimizer
    state, the batch), which is all the step's own memory alive at the start."""

    def __init__(self, alive):
        self.alive = alive

    def start(self) -> int:
        from torch.profiler import ProfilerActivity, profile

        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self.alive()}
        self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.prof.start()
        return sum(storages.values())

    def stop(self) -> tuple[list[dict], dict]:
        self.prof.stop()
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            self.prof.export_chrome_trace(f.name)
            trace = json.load(open(f.name))
        return events_from_profiler_trace(trace), {"max_memory_allocated": None, "max_requested_bytes": None}


def mark(device: torch.device) -> None:
    """A marker on the allocator's event list: ``MARK_BYTES`` allocated and freed at once."""
    torch.empty(MARK_BYTES, dtype=torch.uint8, device=device)


# ---- analysis: pure functions over the events and the plan -----------------------------------------------------------


def events_from_snapshot(snapshot: dict, device_index: int) -> list[dict]:
    """The allocator's trace of one device as ``{"action": "alloc"|"free", "size", "addr", "frames"}``: ``alloc`` and
    ``free_requested`` (the allocated-bytes statistic changes there; ``free_completed`` and segment events do not)."""
    kinds = {"alloc": "alloc", "free_requested": "free"}
    return [{"action": kinds[e["action"]], "size": int(e["size"]), "addr": int(e["addr"]), "frames": e.get("frames", [])}
            for e in snapshot["device_traces"][device_index] if e["action"] in kinds]


def events_from_profiler_trace(trace: dict) -> list[dict]:
    """The ``[memory]`` events of a ``torch.profiler`` chrome trace of CPU memory, in order, as in
    :func:`events_from_snapshot` (no frames)."""
    mem = [e for e in trace["traceEvents"] if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0]
    mem.sort(key=lambda e: (e["ts"], e["args"].get("Ev Idx", 0)))
    return [{"action": "alloc" if e["args"]["Bytes"] > 0 else "free", "size": abs(int(e["args"]["Bytes"])),
             "addr": int(e["args"]["Addr"]), "frames": []} for e in mem if e["args"]["Bytes"]]


def measured_timeline(events: list[dict], baseline: int) -> dict:
    """Allocated bytes after every event (markers left out), each event's phase and normalized x, and the maximum.

    The markers (allocations of ``MARK_BYTES``, with their frees) start the phases in ``PHASES`` order and the last
    one ends the step; there must be ``len(PHASES) + 1`` of them."""
    marker_addrs, starts, kept = set(), [], []
    for e in events:
        if e["action"] == "alloc" and e["size"] == MARK_BYTES:
            marker_addrs.add(e["addr"])
            starts.append(len(kept))
        elif e["action"] == "free" and e["addr"] in marker_addrs:
            marker_addrs.discard(e["addr"])
        else:
            kept.append(e)
    if len(starts) != len(PHASES) + 1:
        raise ValueError(f"expected {len(PHASES) + 1} phase markers in the recorded events, found {len(starts)}")
    total, nbytes, phase, x = baseline, [], [], []
    for k, p in enumerate(PHASES):
        span = kept[starts[k] : starts[k + 1]]
        for i, e in enumerate(span):
            total += e["size"] if e["action"] == "alloc" else -e["size"]
            nbytes.append(total)
            phase.append(p)
            x.append(OFFSET[p] + WIDTH[p] * (i + 1) / len(span))
    events_in = kept[starts[0] : starts[-1]]
    at = max(range(len(nbytes)), key=nbytes.__getitem__) if nbytes else None
    peak = None
    if at is not None:
        e = events_in[at]
        peak = {"bytes": nbytes[at], "phase": phase[at], "x": x[at], "event": at, "size": e["size"],
                "frames": _frames(e["frames"]), "thunder_line": _thunder_line(e["frames"])}
    return {"baseline": baseline, "x": x, "bytes": nbytes, "phase": phase, "peak": peak}


def predicted_timeline(plan) -> dict:
    """The plan's predicted timeline (``timeline_after``: what runs), device model and program alone, on the same
    normalized x: forward steps over [0, 1), the backward's over the backward's span; the first backward step's
    bytes (the loss term's) are held over the loss phase."""
    t = plan.timeline_after
    n, bw = len(t.steps), t.backward_start
    terms = [0] * n
    for term in plan.terms:
        for start, end, b in term.spans:
            for i in range(start, end + 1):
                terms[i] += b
    x = [OFFSET["forward"] + WIDTH["forward"] * i / max(bw, 1) for i in range(bw)]
    x += [OFFSET["backward"] + WIDTH["backward"] * (i - bw) / max(n - bw, 1) for i in range(bw, n)]
    device, program = list(t.live_bytes), [b - c for b, c in zip(t.live_bytes, terms)]
    if bw < n:  # the loss phase: the state at the first backward step
        x.insert(bw, OFFSET["loss"])
        device.insert(bw, device[bw])
        program.insert(bw, program[bw])
    s = t.peak_step
    return {"x": x, "bytes": device, "program_bytes": program,
            "peak": {"bytes": t.peak_bytes, "phase": s.phase, "step": s.index, "label": s.label,
                     "x": x[s.index + (1 if s.index >= bw and bw < n else 0)],
                     "program_peak_bytes": plan.program_peak_bytes_after}}


def plan_step_of(label_line: str | None, plan) -> dict | None:
    """The plan's step whose output names are those assigned on ``label_line`` (a line of Thunder's program)."""
    if not label_line or " = " not in label_line:
        return None
    names = re.findall(r"\w+", label_line.split(" = ")[0])
    for s in plan.timeline_after.steps:
        if " = " in s.label and re.findall(r"\w+", s.label.split(" = ")[0]) == names:
            return {"step": s.index, "phase": s.phase, "label": s.label}
    return None


def downsample(x: list[float], y: list[int], n: int = MAX_POINTS) -> tuple[list[float], list[int]]:
    """At most ``n`` points: the maximum of each bin of consecutive points (peaks survive)."""
    if len(y) <= n:
        return list(x), list(y)
    size = -(-len(y) // n)
    xs, ys = [], []
    for k in range(0, len(y), size):
        j = max(range(k, min(k + size, len(y))), key=y.__getitem__)
        xs.append(x[j])
        ys.append(y[j])
    return xs, ys


def report(plan, events: list[dict], baseline: int, device_stats: dict, text: str | None = None) -> dict:
    """One rank's JSON: prediction, measurement, where each peak is, the terms and both timelines. ``device_stats``:
    ``max_memory_allocated`` and ``max_requested_bytes`` (None on the CPU); ``text``: the plan in words (default:
    ``plan`` alone)."""
    max_allocated = device_stats["max_memory_allocated"]
    pred, meas = predicted_timeline(plan), measured_timeline(events, baseline)
    if meas["peak"] is not None:
        meas["peak"]["plan_step"] = plan_step_of((meas["peak"]["thunder_line"] or {}).get("text"), plan)
    mx, my = downsample(meas["x"], meas["bytes"])
    px, py = downsample(pred["x"], pred["bytes"])
    _, pp = downsample(pred["x"], pred["program_bytes"])
    by_phase = {p: max((b for b, q in zip(meas["bytes"], meas["phase"]) if q == p), default=None) for p in PHASES}
    return {
        "predicted": {"peak_bytes": pred["peak"]["bytes"], "program_peak_bytes": pred["peak"]["program_peak_bytes"],
                      "peak": pred["peak"], "peak_bytes_without_pass": plan.peak_bytes_before,
                      "terms": [{**asdict(t), "nbytes": t.nbytes} for t in plan.terms]},
        "measured": {**device_stats, "rebuilt_max_bytes": (meas["peak"] or {}).get("bytes"),
                     "baseline_bytes": baseline, "peak": meas["peak"], "max_bytes_by_phase": by_phase,
                     "events": len(meas["bytes"])},
        "error_bytes": None if max_allocated is None else pred["peak"]["bytes"] - max_allocated,
        "timelines": {"predicted": {"x": px, "bytes": py, "program_bytes": pp}, "measured": {"x": mx, "bytes": my}},
        "plan_text": text if text is not None else plan_text(plan),
    }


def plot_accuracy(result: dict, path: str | None = None, title: str = ""):
    """Predicted (device model, program alone) and measured timelines of one rank on one normalized axis."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from thunder_fp8shard.format import byte_unit

    t, pred, meas = result["timelines"], result["predicted"], result["measured"]
    top = max([*t["measured"]["bytes"], *t["predicted"]["bytes"], 1])
    unit, scale = byte_unit(top)
    fig = Figure(figsize=(11, 4.8))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(t["measured"]["x"], [b / scale for b in t["measured"]["bytes"]], color="tab:red", lw=1, label="measured")
    ax.plot(t["predicted"]["x"], [b / scale for b in t["predicted"]["bytes"]], drawstyle="steps-post",
            color="tab:blue", label="predicted (device model)")
    ax.plot(t["predicted"]["x"], [b / scale for b in t["predicted"]["program_bytes"]], drawstyle="steps-post",
            color="tab:blue", ls=":", label="predicted (program alone)")
    for name, peak, color in (("measured", meas["peak"], "tab:red"), ("predicted", pred["peak"], "tab:blue")):
        if peak:
            ax.plot([peak["x"]], [peak["bytes"] / scale], "v", color=color, markersize=9, label=f"peak {name}")
            ax.annotate(f"{peak['bytes'] / scale:.4g} {unit} ({peak['phase']})", (peak["x"], peak["bytes"] / scale),
                        xytext=(6, 6 if name == "measured" else -14), textcoords="offset points", fontsize=8, color=color)
    for p in PHASES[1:]:
        ax.axvline(OFFSET[p], color="gray", ls="--", lw=0.8)
    for p in PHASES:
        ax.text(OFFSET[p] + WIDTH[p] / 2, 1.02, p, transform=ax.get_xaxis_transform(), ha="center", fontsize=8)
    ax.set_xlabel("position in the step (each phase normalized)")
    ax.set_ylabel(f"allocated ({unit})")
    ax.set_ylim(0, 1.15 * top / scale)
    ax.set_title(title or "predicted and measured memory of one step", pad=16)
    ax.legend(loc="lower center", ncols=3, fontsize=8)
    fig.tight_layout()
    if path:
        fig.savefig(path, format="png", dpi=120)
    return fig


def _frames(frames: list[dict], n: int = 8) -> list[str]:
    """The innermost ``n`` Python frames, as ``file:line name``."""
    return [f"{f['filename']}:{f['line']} {f['name']}" for f in frames[:n]]


def _thunder_line(frames: list[dict]) -> dict | None:
    """The innermost frame in a program Thunder generated (file ``thunder.<function>_<n>``), with its source line."""
    for f in frames:
        if f["filename"].startswith("thunder."):
            return {"program": f["filename"], "line": f["line"],
                    "text": linecache.getline(f["filename"], f["line"]).strip() or None}
    return None


# ---- the run ----------------------------------------------------------------------------------------------------------


def accuracy_rank(rank: int, world_size: int, cfg, steps: int, snapshot_dir: str | None) -> dict:
    """Trains ``steps`` steps and records the last; returns this rank's report."""
    s = litgpt_run.setup_rank(rank, cfg)
    cuda = s.device.type == "cuda"
    snapshot = os.path.join(snapshot_dir, f"snapshot_rank{rank}.pickle") if snapshot_dir and cuda else None
    recorder = CudaRecorder(s.device, snapshot) if cuda else CpuRecorder(lambda: _alive(s, idx))
    gen = torch.Generator().manual_seed(1000 + rank)
    for step in range(steps):
        record = step == steps - 1
        idx = torch.randint(0, s.vocab_size, (cfg.micro_batch_size, cfg.seq_len + 1), generator=gen).to(s.device)
        x, y = idx[:, :-1], idx[:, 1:]
        if record:
            baseline = recorder.start()
            mark(s.device)
        logits = s.jm(x)
        if record:
            mark(s.device)
            logits.register_hook(lambda grad: mark(s.device))  # the output's gradient is ready: the jitted backward starts
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        if record:
            mark(s.device)
        s.opt.step()
        s.opt.zero_grad(set_to_none=True)
        if record:
            mark(s.device)
            events, device_stats = recorder.stop()
        del logits, loss
    t = trained(s.shard.plans, s.shard.reports)  # the training compilation's plan (testing/trained.py's rule)
    # the prediction as the first call's audit corrected it (what the run checks against), with the checks' lines
    out = report(t.report.corrected(t.plan), events, baseline, device_stats, text=plan_text(t.plan, t.report))
    out.update(rank=rank, world_size=world_size, device=str(s.device), n_params=s.n_params)
    return out


def _alive(s, batch: torch.Tensor) -> list[torch.Tensor]:
    """The tensors of the step alive between steps: parameters, their gradients, the optimizer's state, the batch."""
    params = list(s.jm.parameters())
    state = [v for st in s.opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return [*params, *(p.grad for p in params if p.grad is not None), *state, batch]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    litgpt_run.add_model_args(p)
    p.add_argument("--model", choices=("litgpt", "toy"), default="litgpt", help="toy: fake-FP8 Llama without litgpt")
    p.add_argument("--world-size", type=int, default=2, help="gloo: ranks to spawn (torchrun sets it for nccl)")
    p.add_argument("--backend", choices=("gloo", "nccl", "fake"), default="gloo",
                   help="fake: one process plays rank 0 of --world-size in torch's fake process group (simulated "
                        "ranks: memory as on that many devices, no communication)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--te", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--sdpa", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--checkpoint-activations", action="store_true",
                   help="every block under torch.utils.checkpoint (Thunder's benchmark's --checkpoint_activations=True)")
    p.add_argument("--steps", type=int, default=3, help="AdamW steps; the last one is recorded")
    p.add_argument("--shard", action=argparse.BooleanOptionalAction, default=True,
                   help="--no-shard: the pass plans but shards nothing (policy budget with a budget already met)")
    p.add_argument("--options", default="{}", help='further ShardIntermediates options as JSON, e.g. \'{"prefetch": 0}\'')
    p.add_argument("--optimizer-states", type=int, default=2, help="AdamW: 2")
    p.add_argument("--snapshot-dir", help="CUDA: also write each rank's allocator snapshot (pickle) here")
    p.add_argument("--out", required=True, help="JSON path; the figure goes beside it (.png)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    a = parse_args(argv)
    extra = {"optimizer_states": a.optimizer_states, **json.loads(a.options)}
    if not a.shard:
        extra.update(policy="budget", budget_bytes=1 << 62)  # already within the budget: nothing is sharded
    cfg = litgpt_run.RunConfig(
        model=a.model, model_name=a.model_name, n_layer=a.n_layer, n_embd=a.n_embd, intermediate_size=a.intermediate_size,
        n_head=a.n_head, vocab_size=a.vocab_size, micro_batch_size=a.micro_batch_size, seq_len=a.seq_len, steps=a.steps,
        sdpa=a.sdpa, te=a.te, device=a.device, extra=extra, checkpoint_activations=a.checkpoint_activations,
    )
    if a.backend == "gloo":
        from thunder_fp8shard.testing.harness import run_on_ranks

        ranks = run_on_ranks(accuracy_rank, a.world_size, cfg, a.steps, a.snapshot_dir)
    elif a.backend == "fake":
        from thunder_fp8shard.testing.harness import run_simulated

        ranks = [run_simulated(accuracy_rank, a.world_size, cfg, a.steps, a.snapshot_dir, timeout_s=1800)]
    else:
        if not dist.is_initialized():
            dist.init_process_group("nccl")
        mine = accuracy_rank(dist.get_rank(), dist.get_world_size(), cfg, a.steps, a.snapshot_dir)
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
    result = {"config": {**asdict(replace(cfg)), "backend": a.backend,
                         "world_size": a.world_size if a.backend == "fake" else len(ranks)},
              "device": litgpt_run.device_info(), "ranks": ranks}
    if a.backend != "nccl" or dist.get_rank() == 0:
        write(result, a.out)
        r0 = ranks[0]
        print(f"rank 0: predicted peak {r0['predicted']['peak_bytes']:,} B ({r0['predicted']['peak']['phase']}, "
              f"{r0['predicted']['peak']['label']}); measured {r0['measured']['rebuilt_max_bytes']:,} B rebuilt, "
              f"max_memory_allocated {r0['measured']['max_memory_allocated']} ({r0['measured']['peak']['phase']})",
              flush=True)
    if a.backend == "nccl":
        dist.destroy_process_group()
    return result


def write(result: dict, out: str) -> None:
    """The JSON at ``out`` and rank 0's figure beside it."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    c = result["config"]
    plot_accuracy(result["ranks"][0], os.path.splitext(out)[0] + ".png",
                  title=f"rank 0 of {c['world_size']}: {c['model']} {c['model_name'] if c['model'] == 'litgpt' else ''}"
                  f" {c['n_layer']} layers, seq {c['seq_len']}, {'TE FP8' if c['te'] else 'fake FP8'}, {c['backend']}")


if __name__ == "__main__":
    main()
