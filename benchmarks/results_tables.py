"""The results tables of README.md, docs/results.md and benchmarks/results/EARLIER.md, generated from the committed
JSONs under benchmarks/results/.

    python benchmarks/results_tables.py          # rewrite the generated regions
    python benchmarks/results_tables.py --check  # exit 1, naming each file that is not what the JSONs give

A generated region lies between ``<!-- results:NAME begin ... -->`` and ``<!-- results:NAME end -->``; the text
around it is written by hand. ``results/manifest.json`` is the manifest, data beside the results: each row names its
JSON files and says what was run; every number is read from the files (``tests/test_results_generated.py`` checks the
pages are current).

What is read, per row: the arm's paired JSON (``paired.py``: ``overhead_pct`` median, ``ci95`` and ``base_median``;
``pass_cpu.gross_ms_per_step``; ``memory_reduction_GB`` where no accuracy report is named), the A/A null's paired JSON
(``overhead_pct``), and the accuracy reports of the run without the pass and of the arm (``"kind": "plan_accuracy"``:
``measured_peak_bytes``, the arm's ``error_pct`` = (predicted − measured) / measured). GB = 10^9 bytes.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from benchlib.reporting import fill_regions

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "benchmarks/results"
MINUS = "\u2212"


@dataclass(frozen=True)
class Row:
    """One table row: ``label`` says what ran; the paths are relative to benchmarks/results/. ``memory_only``: the
    arm's times are no evidence (few iterations, beside other jobs), so only its memory is shown."""

    label: str
    arm: str | None = None  # the arm's paired JSON
    null: str | None = None  # the A/A null's paired JSON, from the same launch
    without: str | None = None  # the accuracy report of the run without the pass
    accuracy: str | None = None  # the accuracy report of the arm
    memory_only: bool = False


def manifest(root: Path) -> dict:
    """``results/manifest.json``: the rows of each table, by file (``headline``, ``launches`` by setup with each
    render's words in ``renders``, a launch's ``arm`` where it is not ``default``, ``older`` by sitting)."""
    return json.loads((root / RESULTS / "manifest.json").read_text())


# ---- reading --------------------------------------------------------------------------------------------------------


def load(root: Path, path: str, kind: str) -> dict:
    """A results JSON, or its gzipped copy (``<path>.gz``: the large ones of older sittings)."""
    p = root / RESULTS / path
    d = json.loads(p.read_text() if p.exists() else gzip.decompress(p.with_name(p.name + ".gz").read_bytes()))
    if d.get("kind") != kind:
        raise ValueError(f"{RESULTS}/{path}: kind {d.get('kind')!r}, not {kind!r}")
    if (d.get("model_name", "Llama-2-7b-hf"), d.get("n_layers"), d.get("world_size"), d.get("simulated")) != (
            "Llama-2-7b-hf", 32, 8, True):
        raise ValueError(f"{RESULTS}/{path}: not Llama-2-7b at 32 layers, simulated N=8")
    return d


def signed(x: float, unit: str = "") -> str:
    return f"{'+' if x >= 0 else MINUS}{abs(x):.2f}{unit}"


def overhead(d: dict) -> str:
    o = d["overhead_pct"]
    lo, hi = o["ci95"]
    return f"{signed(o['median'], '%')} [{signed(lo)}, {signed(hi)}]"


@dataclass(frozen=True)
class Figures:
    """One row's figures, formatted."""

    overhead: str
    base: str
    null: str
    peaks: str
    error: str
    pass_cpu: str
    date: str


def figures(root: Path, row: Row) -> Figures:
    arm = load(root, row.arm, "paired") if row.arm else None
    timed = arm is not None and not row.memory_only
    null = load(root, row.null, "paired") if row.null and timed else None
    acc = load(root, row.accuracy, "plan_accuracy") if row.accuracy else None
    if row.without:  # the peaks of the arm's step and of the step without the pass, in one model's process
        w, a = load(root, row.without, "plan_accuracy")["measured_peak_bytes"] / 1e9, acc["measured_peak_bytes"] / 1e9
        peaks = f"{w:.2f} → {a:.2f} ({signed(a - w)})"
    else:  # two models in the process: only the arm's median reduction a step
        peaks = f"{signed(-arm['memory_reduction_GB'])} (saved)"
    error = signed(acc["error_pct"], "%") if acc else ""
    date = (acc or arm)["started"][:10]
    cpu = (arm or {}).get("pass_cpu") or {}
    return Figures(
        overhead(arm) if timed else "memory only",
        f"{arm['overhead_pct']['base_median']:.1f}" if timed else "",
        overhead(null) if null else "",
        peaks, error,
        f"{cpu['gross_ms_per_step']:.2f}" if timed and cpu.get("iterations") else "",
        date)


# ---- the tables -----------------------------------------------------------------------------------------------------


def headline(root: Path) -> str:
    rows = [(r, figures(root, r)) for r in map(lambda e: Row(**e), manifest(root)["headline"]["rows"])]
    date = rows[0][1].date
    out = [f"| the defaults, one H200, simulated N=8 ({date}) | step overhead [95% CI] | base step (ms) | A/A null [95% CI] | "
           "device peak without → with, GB | predicted peak error | pass's CPU a step (ms) |",
           "|---|---|---|---|---|---|---|"]
    out += [f"| {r.label} | {f.overhead} | {f.base} | {f.null} | {f.peaks} | {f.error} | {f.pass_cpu} |"
            for r, f in rows]
    return "\n".join(out) + "\n"


def older(root: Path) -> str:
    out = ["| sitting | run (one H200, simulated N=8) | step overhead [95% CI] | base (ms) | A/A null [95% CI] | peak without → with, GB | "
           "predicted error |", "|---|---|---|---|---|---|---|"]
    for s in manifest(root)["older"]:
        for i, r in enumerate(Row(**e) for e in s["rows"]):
            f = figures(root, r)
            where = f"[{s['sitting'] + ', ' if s['sitting'] else ''}{f.date}]({s['notes']})" if i == 0 else ""
            out.append(f"| {where} | {r.label} | {f.overhead} | {f.base} | {f.null} | {f.peaks} | {f.error} |")
    return "\n".join(out) + "\n"


def launches(root: Path, each_launch: bool = True, left_out: tuple[str, ...] = ()) -> str:
    """Each default's launches by render, but the renders ``left_out`` (their keys): how many, the median of their
    medians, their range, and (``each_launch``) each one."""
    m = manifest(root)
    out = ["| setup | an all-gather rendered as | launches | median of the medians | range |"
           + (" each: overhead [95% CI] (A/A null) |" if each_launch else ""),
           "|---|---|---|---|---|" + ("---|" if each_launch else "")]
    for setup, runs in m["launches"].items():
        for render in dict.fromkeys(r["render"] for r in runs if r["render"] not in left_out):
            mine = [r for r in runs if r["render"] == render]
            medians, each = [], []
            for r in mine:
                d = load(root, f"{r['prefix']}_{r.get('arm', 'default')}.json", "paired")
                null = load(root, f"{r['prefix']}_null.json", "paired")
                medians.append(d["overhead_pct"]["median"])
                each.append(f"{r['sitting']} {r['name']}: {overhead(d)} ({signed(null['overhead_pct']['median'], '%')})")
            mid, low, high = (signed(x, "%") for x in (statistics.median(medians), min(medians), max(medians)))
            out.append(f"| {setup} | {m['renders'][render]} | {len(mine)} | {mid} | {low} to {high} |"
                       + (f" {'; '.join(each)} |" if each_launch else ""))
    return "\n".join(out) + "\n"


def capacity(root: Path) -> str:
    """``results/capacity.json`` (``capacity.py rows``): each cap and setup, each side's fastest configuration that fits
    and the tokens/s ratio of the two, paired."""
    d = json.loads((root / RESULTS / "capacity.json").read_text())
    if d.get("kind") != "capacity":
        raise ValueError(f"{RESULTS}/capacity.json: kind {d.get('kind')!r}, not 'capacity'")

    def side(w: dict | None) -> str:
        if w is None:
            return "nothing fits"
        star = "" if w["tokens_per_s_from"] == "paired" else "*"
        return (f"mb{w['micro_batch']}{' ckpt' if w['checkpointing'] else ''}"
                f"{' xs' if w['config'].endswith('_xs') else ''}, {w['peak_gb']:.1f} GB, "
                f"{w['tokens_per_s'] / 1e3:.1f}k{star}")

    out = ["| cap (GB) | setup | without the pass: config, peak, tokens/s | with `ShardIntermediates()` | with / without "
           "tokens/s [95% CI] |", "|---|---|---|---|---|"]
    for r in d["rows"]:
        ratio = (f"{r['tokens_per_s_ratio']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]" if r["tokens_per_s_ratio"]
                 else "not timed yet")
        setup = r["setup"].upper().replace("_", " ").replace("S", "s")
        out.append(f"| {r['cap_gb']} | {setup} | {side(r['without'])} | {side(r['with'])}"
                   f"{' (same)' if r['same_configuration'] else ''} | {ratio} |")
    xs = any(r[s] and r[s]["config"].endswith("_xs") for r in d["rows"] for s in ("with", "without"))
    return "\n".join(out) + ("\n\n*: the confirming run's, unpaired (beside other compilations), not evidence."
                             + (" xs: expandable segments." if xs else "") + "\n")


PAGES = {"README.md": ("headline", "launches_short", "capacity"), "docs/results.md": ("headline", "launches"),
         f"{RESULTS}/EARLIER.md": ("older",), "docs/capacity.md": ("capacity",)}


def rendered(root: Path = ROOT) -> dict[str, str]:
    """Each page as the JSONs give it: its generated regions rewritten, the rest as it is."""
    tables = {"headline": headline(root), "launches": launches(root), "launches_short": launches(root, False, left_out=("broadcast",)),
              "older": older(root), "capacity": capacity(root)}
    return {page: fill_regions((root / page).read_text(), "results", tables, names, page)
            for page, names in PAGES.items()}


def stale(root: Path = ROOT) -> list[str]:
    """The pages whose generated regions differ from what the JSONs give."""
    return [page for page, text in rendered(root).items() if (root / page).read_text() != text]


def main(argv: list[str] | None = None, root: Path = ROOT) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page is not what the JSONs give")
    args = p.parse_args(argv)
    if args.check:
        old = stale(root)
        for page in old:
            print(f"{page} is stale: run python benchmarks/results_tables.py", file=sys.stderr)
        return 1 if old else 0
    for page, text in rendered(root).items():
        if (root / page).read_text() != text:
            (root / page).write_text(text)
            print(f"wrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
