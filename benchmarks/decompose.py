"""Where an arm's overhead goes, from one paired run (``paired.py --profile``): the overheads measured (wall and CPU
issue, paired, with their CIs), each profiled arm's run-time operators by kind (calls a step, CPU µs a call, CPU and
device ms a step: :func:`profile_summary.pass_op_costs` over the arm's Chrome trace), and the torch operators whose
self CPU time a step grew the most against the base's profiled step (``torch.profiler``'s key averages, the top
rows each arm's JSON keeps). One markdown report.

    python benchmarks/decompose.py benchmarks/results/h200_2026-12-02b/paired_fp8_l8_n8_one_model \\
        --traces benchmarks/results/h200_2026-12-02b/profile_fp8_l8_n8_one_model_{arm}.json.gz

The profiler's own cost is in every figure (its ``record_function`` range and the operators it records): an empty
operator (an audit after its first call) shows what that is on the machine.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from profile_summary import load, pass_op_costs, pass_op_table  # noqa: E402


def _ci(o: dict) -> str:
    lo, hi = o["ci95"]
    return f"{o['median']:+.2f}% [{lo:+.2f}, {hi:+.2f}]"


def overheads(results: list[dict]) -> str:
    lines = ["| arm | wall overhead [95% CI] | ms | CPU issue overhead [CI] | memory saved (GB) |", "|---|---|---|---|---|"]
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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("prefix", help="the run's JSON prefix (<prefix>_<arm>.json)")
    p.add_argument("--traces", help="the profiled arms' Chrome traces, {arm} standing for the arm's name")
    a = p.parse_args(argv)
    results = [json.load(open(f)) for f in sorted(glob.glob(a.prefix + "_*.json"))]
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


if __name__ == "__main__":
    main()
