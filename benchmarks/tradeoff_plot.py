"""The trade-off of memory against time: each paired arm's step overhead (median, 95% CI) against the device memory it
saves per rank, one series a configuration, from the paired benchmark's JSONs (``paired.py``: one ``<out>_<arm>.json``
a comparison). Writes the figure (PNG) and the points it draws (JSON) so that a user can pick a point.

    python benchmarks/tradeoff_plot.py --series "FP8, 32 layers" benchmarks/results/paired/paired_fp8_l32_n8_compaction \\
        --series "bf16 candidates=all, 32 layers" benchmarks/results/paired/paired_bf16_l32_n8_compaction \\
        --out benchmarks/results/tradeoff_l32_n8
"""

from __future__ import annotations

import argparse
import glob
import json
import os

from benchlib.reporting import load


def points(prefix: str, exclude: frozenset[str] = frozenset()) -> list[dict]:
    """One point per arm with the pass among ``<prefix>_<arm>.json`` (the accuracy reports, A/A nulls and the arms
    named in ``exclude`` left out)."""
    out = []
    for path in sorted(glob.glob(f"{prefix}_*.json") + glob.glob(f"{prefix}_*.json.gz")):  # older sittings' gzipped
        r = load(path)
        if r.get("kind") != "paired" or r.get("null") or r["arm"] in exclude:
            continue
        o = r["overhead_pct"]
        plan = next(a for a in r["arms"] if a["name"] == r["arm"])["plan"] or {}
        out.append({
            "arm": r["arm"], "options": r["options"], "saved_GB": r["memory_reduction_GB"],
            "overhead_pct": o["median"], "ci95": o["ci95"], "overhead_ms": o["median_abs"],
            "base_median_ms": o["base_median"], "gathered_GB_per_step": (r.get("gathered_bytes_per_step") or 0) / 1e9,
            "compacted_GB_per_step": (r.get("compacted_bytes") or 0) / 1e9,
            "budget_met": (r.get("budget") or {}).get("met"), "file": os.path.basename(path),
            "simulated": r["simulated"], "world_size": r["world_size"], "n_layers": r["n_layers"],
            "sharded": plan.get("sharded"), "compactions": plan.get("compactions"),
        })
    return sorted(out, key=lambda p: p["saved_GB"])


def plot(series: dict[str, list[dict]], path: str, title: str):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.5, 5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for (name, pts), marker in zip(series.items(), ("o", "s", "^", "D")):
        xs = [p["saved_GB"] for p in pts]
        ys = [p["overhead_pct"] for p in pts]
        err = [[p["overhead_pct"] - p["ci95"][0] for p in pts], [p["ci95"][1] - p["overhead_pct"] for p in pts]]
        ax.errorbar(xs, ys, yerr=err, fmt=marker + "-", capsize=4, label=name)
        for p in pts:
            ax.annotate(p["arm"], (p["saved_GB"], p["overhead_pct"]), xytext=(5, 5), textcoords="offset points",
                        fontsize=8)
    ax.axhline(0, color="gray", lw=0.8)
    ax.set_xlabel("device memory saved per rank (GB, median per iteration)")
    ax.set_ylabel("step overhead (%, paired median, 95% CI)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=120)
    return fig


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--series", nargs=2, action="append", metavar=("NAME", "PREFIX"), required=True)
    p.add_argument("--out", required=True, help="path prefix: <out>.png and <out>.json")
    p.add_argument("--exclude", nargs=2, action="append", default=[], metavar=("NAME", "ARM"),
                   help="leave series NAME's arm ARM out (e.g. a run of a pass with a known bug)")
    p.add_argument("--title", default="ShardIntermediates: memory saved against step time (one H200, simulated N=8)")
    a = p.parse_args(argv)
    series = {name: points(prefix, frozenset(arm for n, arm in a.exclude if n == name)) for name, prefix in a.series}
    with open(a.out + ".json", "w") as f:
        json.dump({"kind": "tradeoff", "title": a.title, "series": series}, f, indent=1)
    plot(series, a.out + ".png", a.title)
    print(f"wrote {a.out}.png and {a.out}.json")


if __name__ == "__main__":
    main()
