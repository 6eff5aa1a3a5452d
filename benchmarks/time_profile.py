"""Where a profiled training step's time goes, from ``torch.profiler`` Chrome traces (CPU + CUDA activities, one
rank). Subcommands:

- ``step [--table] TRACE``: one step's trace summarized as JSON (:func:`summarize`), or its pass's operators as a
  markdown table (:func:`pass_op_table`);
- ``paired PREFIX [--traces TRACES]``: where each arm's overhead goes in one profiled paired run, as markdown.
"""

from __future__ import annotations

import bisect
import glob
import json
import os
from collections import defaultdict

from benchlib.reporting import load, subcommands

LAUNCH_SLACK_US = 5.0  # a kernel launched less than this before the gap began counts as launched late
NCCL_PREFIX = ("ncclDevKernel", "ncclKernel")
BACKWARD_MARK = "ThunderFunctionBackward"


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _gaps(kernels: list[dict], launch_ts: dict, min_gap_us: float) -> list[dict]:
    """Idle gaps between consecutive kernels of one stream, each with its class and the kernels around it."""
    busy_end, prev_name, gaps = None, None, []
    for k in sorted(kernels, key=lambda k: k["ts"]):
        if busy_end is not None and k["ts"] - busy_end >= min_gap_us:
            launched = launch_ts.get(k["args"].get("correlation"))
            late = launched is not None and launched + LAUNCH_SLACK_US > busy_end
            gaps.append({"start_us": busy_end, "us": k["ts"] - busy_end, "kind": "cpu" if late else "wait",
                         "before": prev_name, "after": k["name"]})
        end = k["ts"] + k.get("dur", 0)
        if busy_end is None or end > busy_end:
            busy_end, prev_name = end, k["name"]
    return gaps


def _stream_stats(kernels: list[dict], launch_ts: dict, min_gap_us: float) -> dict:
    if not kernels:
        return {"kernels": 0}
    busy = sum(b - a for a, b in _union([(k["ts"], k["ts"] + k.get("dur", 0)) for k in kernels]))
    span = max(k["ts"] + k.get("dur", 0) for k in kernels) - min(k["ts"] for k in kernels)
    gaps = _gaps(kernels, launch_ts, min_gap_us)
    by_kind = defaultdict(float)
    for g in gaps:
        by_kind[g["kind"]] += g["us"]
    return {
        "kernels": len(kernels), "span_ms": span / 1e3, "busy_ms": busy / 1e3, "idle_ms": (span - busy) / 1e3,
        "gaps": len(gaps), "gap_ms_by_kind": {k: v / 1e3 for k, v in sorted(by_kind.items())},
        "largest_gaps": [dict(g, us=round(g["us"], 1)) for g in sorted(gaps, key=lambda g: -g["us"])[:8]],
    }


DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def pass_op_costs(trace: dict) -> dict:
    """The pass's operators by name: calls, CPU ms (their ``record_function`` ranges, children included) and device ms
    (the kernels, copies and memsets whose launch, matched by correlation id, lies inside one of its calls on the same
    CPU thread). Nested ranges count for the innermost."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    ranges = sorted(((e["ts"], e["ts"] + e.get("dur", 0), e.get("tid"), e["name"]) for e in events
                     if e.get("cat") in ("user_annotation", "cpu_op") and e["name"].startswith("fp8shard_")),
                    key=lambda r: r[0])
    out: dict = {}
    for lo, hi, _, name in ranges:
        row = out.setdefault(name, {"calls": 0, "cpu_ms": 0.0, "device_ms": 0.0, "device_events": 0})
        row["calls"] += 1
        row["cpu_ms"] += (hi - lo) / 1e3
    launches = {e["args"]["correlation"]: (e["ts"], e.get("tid")) for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    starts = [r[0] for r in ranges]
    for d in (e for e in events if e.get("cat") in DEVICE_CATS):
        at = launches.get(d.get("args", {}).get("correlation"))
        if at is None:
            continue
        ts, tid = at
        inner = None
        for lo, hi, rtid, name in reversed(ranges[: bisect.bisect_right(starts, ts)]):
            if lo <= ts <= hi and rtid == tid:
                inner = name if inner is None else inner
                break
        if inner is not None:
            out[inner]["device_ms"] += d.get("dur", 0) / 1e3
            out[inner]["device_events"] += 1
    for row in out.values():
        row["cpu_us_per_call"] = 1e3 * row["cpu_ms"] / row["calls"]
        row["cpu_ms"], row["device_ms"] = round(row["cpu_ms"], 4), round(row["device_ms"], 4)
    return dict(sorted(out.items()))


def pass_op_table(costs: dict) -> str:
    """:func:`pass_op_costs` as a markdown table, with a total row."""
    lines = ["| operator | calls a step | CPU µs a call | CPU ms a step | device ms a step | device events |",
             "|---|---|---|---|---|---|"]
    for name, r in costs.items():
        lines.append(f"| `{name}` | {r['calls']} | {r['cpu_us_per_call']:.1f} | {r['cpu_ms']:.3f} | "
                     f"{r['device_ms']:.3f} | {r['device_events']} |")
    calls = sum(r["calls"] for r in costs.values())
    lines.append(f"| total | {calls} | | {sum(r['cpu_ms'] for r in costs.values()):.3f} | "
                 f"{sum(r['device_ms'] for r in costs.values()):.3f} | "
                 f"{sum(r['device_events'] for r in costs.values())} |")
    return "\n".join(lines)


def summarize(trace: dict, min_gap_us: float = 10.0) -> dict:
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    launch_ts = {e["args"]["correlation"]: e["ts"] for e in events
                 if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    cpu = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "python_function")]

    by_stream: dict[int, list[dict]] = defaultdict(list)
    for k in kernels:
        by_stream[k["args"].get("stream", -1)].append(k)
    is_nccl = lambda k: k["name"].startswith(NCCL_PREFIX)  # noqa: E731
    compute_time = {s: sum(k.get("dur", 0) for k in ks if not is_nccl(k)) for s, ks in by_stream.items()}
    compute = max(compute_time, key=compute_time.get) if compute_time else None

    backward = [e for e in cpu if BACKWARD_MARK in e["name"]]
    bw_lo = min((e["ts"] for e in backward), default=None)
    bw_hi = max((e["ts"] + e.get("dur", 0) for e in backward), default=None)

    def launched_in_backward(k):
        t = launch_ts.get(k["args"].get("correlation"))
        return bw_lo is not None and t is not None and bw_lo <= t <= bw_hi

    nccl = {}
    for s, ks in sorted(by_stream.items()):
        coll = [k for k in ks if is_nccl(k)]
        if coll:
            kinds = defaultdict(lambda: [0, 0.0])
            for k in coll:
                kind = k["name"].split("(")[0]
                kinds[kind][0] += 1
                kinds[kind][1] += k.get("dur", 0) / 1e3
            nccl[str(s)] = {"kernels": len(coll), "ms": sum(k.get("dur", 0) for k in coll) / 1e3,
                            "kinds": {n: {"count": c, "ms": round(ms, 3)} for n, (c, ms) in sorted(kinds.items())}}

    ranges = defaultdict(lambda: [0, 0.0])
    for e in cpu:
        n = e["name"]
        if n.startswith("fp8shard_") or n.startswith(("c10d::", "nccl:", "record_param_comms")):
            ranges[n][0] += 1
            ranges[n][1] += e.get("dur", 0) / 1e3

    cpu_lo = min((e["ts"] for e in cpu), default=0.0)
    cpu_hi = max((e["ts"] + e.get("dur", 0) for e in cpu), default=0.0)
    main = by_stream.get(compute, [])
    return {
        "cpu_span_ms": (cpu_hi - cpu_lo) / 1e3,
        "backward_cpu_ms": (bw_hi - bw_lo) / 1e3 if backward else None,
        "compute_stream": compute,
        "compute": _stream_stats(main, launch_ts, min_gap_us),
        "compute_backward": _stream_stats([k for k in main if launched_in_backward(k)], launch_ts, min_gap_us),
        "nccl_streams": nccl,
        "cpu_ranges": {n: {"count": c, "ms": round(ms, 3)} for n, (c, ms) in sorted(ranges.items())},
        "pass_ops": pass_op_costs(trace),
    }


def _ci(o: dict) -> str:
    lo, hi = o["ci95"]
    return f"{o['median']:+.2f}% [{lo:+.2f}, {hi:+.2f}]"


def overheads(results: list[dict]) -> str:
    lines = ["| arm | wall overhead [95% CI] | ms | CPU issue overhead [CI] | memory saved (GB) |",
             "|---|---|---|---|---|"]
    for r in results:
        o, c = r["overhead_pct"], r.get("cpu_issue_overhead_pct") or r.get("issue_overhead_pct")
        lines.append(f"| {r['arm']} | {_ci(o)} | {o['median_abs']:+.2f} | {_ci(c) if c else ''} | "
                     f"{r['memory_reduction_GB']:.2f} |")
    return "\n".join(lines)


def grown(base_rows: list[dict], rows: list[dict], top: int = 10) -> str:
    """The torch operators whose self CPU time a step grew the most (arm minus base, µs), from the key averages."""
    before = {r["name"]: r for r in base_rows}
    diffs = []
    for r in rows:
        b = before.get(r["name"], {"self_cpu_us": 0.0, "calls": 0})
        diffs.append((r["self_cpu_us"] - b["self_cpu_us"], r["name"], r["calls"] - b["calls"]))
    lines = ["| operator | self CPU µs a step, more than the base | calls more |", "|---|---|---|"]
    for d, name, calls in sorted(diffs, reverse=True)[:top]:
        lines.append(f"| `{name[:70]}` | {d:+.0f} | {calls:+d} |")
    return "\n".join(lines)


def run_step(a) -> None:
    """Where one training step's time goes, from its Chrome trace: :func:`summarize` as JSON, or with ``--table`` the
    pass's operators as a markdown table. The summary, plain data:

    - the step's CPU span and GPU span; the compute stream (the stream with the most non-NCCL kernel time), its busy
      time and its idle gaps, for the whole step and for the backward (kernels launched while autograd runs
      Thunder's backward);
    - each idle gap of the compute stream classified by the kernel that ends it: ``"cpu"`` when that kernel was
      launched after the stream went idle (the GPU waited for the CPU to issue work), ``"wait"`` when it had been
      launched before (it waited for an event, e.g. the end of a collective on another stream);
    - NCCL kernels per stream (count, time, kinds);
    - CPU time inside the pass's operators (their ``record_function`` ranges, ``fp8shard_*``) and inside the
      collectives' CPU calls;
    - each of the pass's operators by kind (``pass_ops``): calls, CPU time (µs a call, ms a step) and the device
      time of the kernels, copies and memsets launched inside its calls (:func:`pass_op_costs`).
    """
    if a.table:
        print(pass_op_table(pass_op_costs(load(a.trace))))
    else:
        print(json.dumps(summarize(load(a.trace)), indent=1))


def run_paired(a) -> None:
    """Where an arm's overhead goes, from one profiled paired run (``paired.py --profile``), as one markdown report.

    The overheads measured (wall and CPU issue, paired, with their CIs), each profiled arm's run-time operators by kind
    (calls a step, CPU µs a call, CPU and device ms a step: :func:`pass_op_costs` over the arm's Chrome trace), and the
    torch operators whose self CPU time a step grew the most against the base's profiled step (``torch.profiler``'s key
    averages, the top rows each arm's JSON keeps).

        python benchmarks/time_profile.py paired benchmarks/results/h200_2026-12-02b/paired_fp8_l8_n8_one_model \\
            --traces benchmarks/results/h200_2026-12-02b/profile_fp8_l8_n8_one_model_{arm}.json.gz

    The profiler's own cost is in every figure (its ``record_function`` range and the operators it records): an empty
    operator (an audit after its first call) shows what that is on the machine.
    """
    results = [load(f) for f in sorted(glob.glob(a.prefix + "_*.json") + glob.glob(a.prefix + "_*.json.gz"))]
    results = [r for r in results if r.get("kind") == "paired"]
    print(f"# {os.path.basename(a.prefix)}\n\n{results[0]['design']}; {results[0]['communication']}; "
          f"base median {results[0]['overhead_pct']['base_median']:.1f} ms\n")
    print(overheads(results) + "\n")
    profile = {}  # each file may keep only its own arm's and the base's profile
    for r in results:
        profile.update(r.get("profile") or {})
    base = results[0]["base"]
    for arm, prof in profile.items():
        if arm == base:
            continue
        print(f"## {arm}\n")
        if a.traces and os.path.exists(a.traces.format(arm=arm)):
            print(pass_op_table(pass_op_costs(load(a.traces.format(arm=arm)))) + "\n")
        if base in profile:
            print(grown(profile[base]["top_self_cpu"], prof["top_self_cpu"]) + "\n")


def main(argv=None) -> None:
    parser, add = subcommands(__doc__)
    p = add("step", run_step)
    p.add_argument("--table", action="store_true", help="the pass's operators as a markdown table, not the summary")
    p.add_argument("trace", help="a torch.profiler Chrome trace (.json or .json.gz)")
    p = add("paired", run_paired)
    p.add_argument("prefix", help="the run's JSON prefix (<prefix>_<arm>.json)")
    p.add_argument("--traces", help="the profiled arms' Chrome traces, {arm} standing for the arm's name")
    a = parser.parse_args(argv)
    a.run(a)


if __name__ == "__main__":
    main()
