"""The results tables of README.md, docs/results.md and benchmarks/results/EARLIER.md, generated from the committed
JSONs under benchmarks/results/.

    python benchmarks/results_tables.py          # rewrite the generated regions
    python benchmarks/results_tables.py --check  # exit 1, naming each file that is not what the JSONs give

A generated region lies between ``<!-- results:NAME begin ... -->`` and ``<!-- results:NAME end -->``; the text
around it is written by hand. ``HEADLINE``, ``LAUNCHES`` and ``OLDER`` below are the manifest: each row names its
JSON files and says what was run; every number is read from the files (``tests/test_results_generated.py`` checks
the pages are current).

What is read, per row: the arm's paired JSON (``paired.py``: ``overhead_pct`` median, ``ci95`` and ``base_median``;
``pass_cpu.gross_ms_per_step``; ``memory_reduction_GB`` where no accuracy report is named), the A/A null's paired JSON
(``overhead_pct``), and the accuracy reports of the run without the pass and of the arm (``"kind": "plan_accuracy"``:
``measured_peak_bytes``, the arm's ``error_pct`` = (predicted − measured) / measured). GB = 10^9 bytes.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

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


def run(prefix: str, arm: str, label: str, *, null: str | None = "null", accuracy: bool = True,
        memory_only: bool = False) -> Row:
    """A row of ``paired.py``'s files ``<prefix>_<arm>.json``, ``<prefix>_<null>.json`` and
    ``<prefix>_accuracy_{without,<arm>}.json``."""
    return Row(label, f"{prefix}_{arm}.json", f"{prefix}_{null}.json" if null else None,
               f"{prefix}_accuracy_without.json" if accuracy else None,
               f"{prefix}_accuracy_{arm}.json" if accuracy else None, memory_only)


def memory_run(prefix: str, arm: str, label: str) -> Row:
    """A row of ``run``'s files whose times are no evidence: no null, only memory shown."""
    return run(prefix, arm, label, null=None, memory_only=True)


@dataclass(frozen=True)
class Sitting:
    name: str
    notes: str  # its NOTES.md, relative to benchmarks/results/
    rows: tuple[Row, ...]


S16 = "h200_2026-12-03d/s16/paired/final"
S19, S20 = "h200_2026-12-04/s19/paired/final", "h200_2026-12-04/s20/paired/final"
S22 = "h200_2026-12-04/s22/ckpt_fp8_te_bw"  # the memory model's fix for a TE linear recomputed in the backward
HEADLINE = Sitting("s19", "h200_2026-12-04/NOTES.md", (
    run(f"{S19}_fp8_l32_n8_e", "default", "FP8 (TE), the default (s19, launch e)"),
    run(f"{S19}_bf16_l32_n8_b", "default", "bf16, the default (s19, launch b)"),
    Row("FP8 (TE), checkpointed blocks, the default (s20; memory s22)",
        f"{S20}_ckpt_fp8_l32_n8_t_default.json", f"{S20}_ckpt_fp8_l32_n8_t_null.json",
        f"{S22}_accuracy_without.json", f"{S22}_accuracy_default.json"),
    run(f"{S20}_ckpt_bf16_l32_n8_t", "default", "bf16, checkpointed blocks, the default (s20)"),
))


@dataclass(frozen=True)
class Launch:
    """One launch of a configuration: its sitting, its name there, how the simulation rendered an all-gather (the
    instrument changed between sittings), and its files' prefix (``paired.py``'s ``<prefix>_{default,null}.json``)."""

    sitting: str
    name: str
    render: str
    prefix: str

    @property
    def row(self) -> Row:
        return run(self.prefix, "default", "")


BROADCAST, CAT = "a broadcast `copy_` (s16)", "one `cat` (since s17)"
SIDE = "one `cat`, the pass's on a side stream"  # paired.py --comm-stream
H100 = "one `cat`, on one H100; a shard op one launch (s26)"  # no H200 was lent: the card differs from every launch before
S26 = "h100_2026-12-05/s26/paired/final"
S18, S21 = "h200_2026-12-04/s18/paired/final", "h200_2026-12-04/s21/paired/final"
S23, S24 = "h200_2026-12-04/s23/paired/final", "h200_2026-12-04/s24/paired/final"
# every launch of each default at 32 layers since the defaults changed (s16), none left out
LAUNCHES = {
    "FP8 (TE), the default": (
        Launch("s16", "a", BROADCAST, f"{S16}_fp8_l32_n8_a"),
        Launch("s16", "b", BROADCAST, f"{S16}_fp8_l32_n8_b"),
        Launch("s18", "c", CAT, f"{S18}_fp8_l32_n8_c"),
        Launch("s18", "d", CAT, f"{S18}_fp8_l32_n8_d"),
        Launch("s19", "e", CAT, f"{S19}_fp8_l32_n8_e"),
        Launch("s21", "f", CAT, f"{S21}_fp8_l32_n8_f"),
        Launch("s23", "g", CAT, f"{S23}_fp8_l32_n8_g"),
        Launch("s24", "h", CAT, f"{S24}_fp8_l32_n8_h"),
        Launch("s26", "i", H100, f"{S26}_fp8_l32_n8_i"),
        Launch("s20", "a", SIDE, f"{S20}_fp8_l32_n8_stream"),
        Launch("s21", "b", SIDE, f"{S21}_fp8_l32_n8_stream_b"),
    ),
    "bf16, the default": (
        Launch("s16", "a", BROADCAST, f"{S16}_bf16_l32_n8"),
        Launch("s19", "b", CAT, f"{S19}_bf16_l32_n8_b"),
        Launch("s19", "c", CAT, f"{S19}_bf16_l32_n8_c"),
        Launch("s20", "d", CAT, f"{S20}_bf16_l32_n8_d"),
        Launch("s24", "e", CAT, f"{S24}_bf16_l32_n8_e"),
    ),
    "FP8 (TE), checkpointed, the default": (
        Launch("s20", "t", CAT, f"{S20}_ckpt_fp8_l32_n8_t"),
        Launch("s23", "u", CAT, f"{S23}_ckpt_fp8_l32_n8_u"),
    ),
    "bf16, checkpointed, the default": (Launch("s20", "t", CAT, f"{S20}_ckpt_bf16_l32_n8_t"),),
}

S13, S12, S11, S9 = "h200_2026-12-03c/s13", "h200_2026-12-03b/s12", "h200_2026-12-03b/s11", "h200_2026-12-03/s9"
S7 = "h200_2026-12-02d"
S4, S56 = "h200_2026-12-02b", "h200_2026-12-02c"  # s3 and s4; s5 and s6
OLDER = (
    Sitting("s26", "h100_2026-12-05/NOTES.md", (
        run(f"{S26}_fp8_l32_n8_i", "old", "FP8, the pass at 0b4b687 (before one launch a shard op), beside launch i, "
            "one H100"),
    )),
    Sitting("s24", "h200_2026-12-04/NOTES.md", (
        run(f"{S24}_fp8_l32_n8_h", "nocompact", 'FP8, the default with `compact="off"`, beside launch h'),
        run(f"{S24}_fp8_l32_n8_h", "compact", "FP8, compaction alone, beside launch h"),
    )),
    Sitting("s16", "h200_2026-12-03d/NOTES.md", (
        run(f"{S16}_fp8_l32_n8_a", "fwdgather", "FP8 (TE), `fp8_forward_gather=True`, beside the default's launch a"),
    )),
    Sitting("s13", "h200_2026-12-03c/NOTES.md", (
        run(f"{S13}/paired_fp8_l32_n8_s13", "default", "FP8, the default of then (`reschedule` off), third launch"),
        run(f"{S13}/resched_fp8_l32_n8", "default", "FP8, the default of then"),
        run(f"{S13}/resched_fp8_l32_n8", "resched", "FP8, `reschedule=True` (not kept: the same program)"),
        run(f"{S13}/resched_ckpt_fp8_l32_n8", "all", 'FP8 checkpointed, `"all"`'),
        run(f"{S13}/resched_ckpt_fp8_l32_n8", "resched", 'FP8 checkpointed, `"all"`, `reschedule=True`'),
        run(f"{S13}/resched_bf16_l32_n8", "all", 'bf16, `"all"`', null=None),
        run(f"{S13}/resched_bf16_l32_n8", "resched", 'bf16, `"all"`, `reschedule=True` (not kept)', null=None),
    )),
    Sitting("s12", "h200_2026-12-03b/NOTES.md", (
        run(f"{S12}/paired_bf16_l32_n8_own", "all", 'bf16, `"all"` with own shards'),
        memory_run(f"{S12}/ckpt_resched_bf16_l32_n8", "all", 'bf16 checkpointed, `"all"`'),
        memory_run(f"{S12}/ckpt_resched_bf16_l32_n8", "resched", 'bf16 checkpointed, `"all"`, `reschedule=True`'),
    )),
    Sitting("s11", "h200_2026-12-03b/NOTES.md", (
        memory_run(f"{S11}/ckpt_resched_fp8_l32_n8", "all", 'FP8 checkpointed, `"all"`'),
        memory_run(f"{S11}/ckpt_resched_fp8_l32_n8", "resched", 'FP8 checkpointed, `"all"`, `reschedule=True`'),
    )),
    Sitting("s9", "h200_2026-12-03/NOTES.md", (
        memory_run(f"{S9}/fp8_l32_n8_memory", "default", "FP8, the default of then (`fp8_forward_gather` on)"),
        memory_run(f"{S9}/fp8_l32_n8_memory", "bf16gather", "FP8, `fp8_forward_gather=False`"),
    )),
    Sitting("s7", "h200_2026-12-02d/NOTES.md", (
        memory_run(f"{S7}/ckpt_fp8_l32_n8", "default", "FP8 checkpointed, the default of then (nothing sharded)"),
        memory_run(f"{S7}/ckpt_fp8_l32_n8", "all", 'FP8 checkpointed, `"all"`'),
        memory_run(f"{S7}/ckpt_bf16_l32_n8", "all", 'bf16 checkpointed, `"all"`'),
    )),
    Sitting("s6", "h200_2026-12-02c/NOTES.md", (
        run(f"{S56}/paired_fp8_l32_n8_fwd", "fwdgather", "FP8, `fp8_forward_gather` (two operators), launch 1"),
        run(f"{S56}/paired_fp8_l32_n8_fwd_again", "fwdgather", "the same, launch 2"),
        run(f"{S56}/paired_fp8_l32_n8_fwd", "default", "FP8, without it, launch 1"),
        run(f"{S56}/paired_fp8_l32_n8_fwd_again", "default", "FP8, without it, launch 2"),
    )),
    Sitting("s5", "h200_2026-12-02c/NOTES.md", (
        run(f"{S56}/paired_bf16_l32_n8_again", "all", 'bf16, `"all"`, second launch'),
    )),
    Sitting("s4", "h200_2026-12-02b/NOTES.md", (
        run(f"{S4}/paired_fp8_l32_n8_curve", "default", "FP8, the default of then (43 calls a step)"),
        run(f"{S4}/paired_fp8_l32_n8_again", "default", "the same, second launch"),
        run(f"{S4}/paired_fp8_l32_n8_curve", "old", "FP8, the pass at 596b2e3 (77 calls)"),
        run(f"{S4}/paired_fp8_l32_n8_again", "fwdgather", "FP8, `fp8_forward_gather`, first version (three operators)"),
        run(f"{S4}/paired_fp8_l32_n8_curve", "compact", "FP8, compaction alone"),
        *(run(f"{S4}/paired_fp8_l32_n8_curve", f"budget{b}", f'FP8, `policy="budget"` {b} GB under') for b in (1, 2, 4, 6)),
        run(f"{S4}/paired_bf16_l32_n8_curve", "all", 'bf16, `"all"`'),
        run(f"{S4}/paired_bf16_l32_n8_curve", "compact", "bf16, compaction alone"),
        *(run(f"{S4}/paired_bf16_l32_n8_curve", f"budget{b}", f'bf16, `policy="budget"` {b} GB under') for b in (4, 8)),
    )),
    Sitting("s2", "h200_2026-12-02/NOTES.md", (
        Row('FP8, `policy="budget"` 3 GB under', "h200_2026-12-02/paired_fp8_l32_n8_budget_budget3.json",
            accuracy="h200_2026-12-02/paired_fp8_l32_n8_budget_accuracy_budget3.json"),
    )),
    Sitting("", "paired/NOTES.md", (
        Row("FP8, the pass of then (125 calls a step)", "paired/paired_fp8_l32_n8_with.json",
            "paired/paired_fp8_l32_n8_null.json"),
        Row("FP8, 50 calls a step", "paired/paired_fp8_l32_n8_fewer_calls_with.json"),
        Row("the same, its gathers on a stream of their own (`--comm-stream`)",
            "paired/paired_fp8_l32_n8_comm_stream_with.json"),
        Row('bf16, `"all"` (282 calls a step)', "paired/paired_bf16_l32_n8_with.json"),
    )),
)


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
    rows = [(r, figures(root, r)) for r in HEADLINE.rows]
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
    for s in OLDER:
        for i, r in enumerate(s.rows):
            f = figures(root, r)
            where = f"[{s.name + ', ' if s.name else ''}{f.date}]({s.notes})" if i == 0 else ""  # beside the notes
            out.append(f"| {where} | {r.label} | {f.overhead} | {f.base} | {f.null} | {f.peaks} | {f.error} |")
    return "\n".join(out) + "\n"


def launches(root: Path, each_launch: bool = True, left_out: tuple[str, ...] = ()) -> str:
    """Each default's launches by render, but the renders ``left_out``: how many, the median of their medians, their
    range, and (``each_launch``) each one."""
    out = ["| setup | an all-gather rendered as | launches | median of the medians | range |"
           + (" each: overhead [95% CI] (A/A null) |" if each_launch else ""),
           "|---|---|---|---|---|" + ("---|" if each_launch else "")]
    for setup, runs in LAUNCHES.items():
        for render in dict.fromkeys(r.render for r in runs if r.render not in left_out):
            mine = [r for r in runs if r.render == render]
            medians, each = [], []
            for r in mine:
                d = load(root, r.row.arm, "paired")
                null = load(root, r.row.null, "paired")
                medians.append(d["overhead_pct"]["median"])
                each.append(f"{r.sitting} {r.name}: {overhead(d)} ({signed(null['overhead_pct']['median'], '%')})")
            mid, low, high = (signed(x, "%") for x in (statistics.median(medians), min(medians), max(medians)))
            out.append(f"| {setup} | {render} | {len(mine)} | {mid} | {low} to {high} |"
                       + (f" {'; '.join(each)} |" if each_launch else ""))
    return "\n".join(out) + "\n"


PAGES = {"README.md": ("headline", "launches_short"), "docs/results.md": ("headline", "launches"),
         f"{RESULTS}/EARLIER.md": ("older",)}
REGION = re.compile(r"(<!-- results:(\w+) begin[^>]*-->\n)(.*?)(<!-- results:\2 end -->)", re.S)


def rendered(root: Path = ROOT) -> dict[str, str]:
    """Each page as the JSONs give it: its generated regions rewritten, the rest as it is."""
    tables = {"headline": headline(root), "launches": launches(root), "launches_short": launches(root, False, left_out=(BROADCAST,)),
              "older": older(root)}
    pages = {}
    for page, names in PAGES.items():
        text = (root / page).read_text()
        found = [m.group(2) for m in REGION.finditer(text)]
        if sorted(found) != sorted(names):
            raise ValueError(f"{page}: generated regions {found}, expected {list(names)}")
        pages[page] = REGION.sub(lambda m: m.group(1) + tables[m.group(2)] + m.group(4), text)
    return pages


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
