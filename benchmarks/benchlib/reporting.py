"""What the benchmarks report: the pass's plan as plain data, the device, the flags given to Thunder's benchmark
(after ``--``), a tool's subcommands, a JSON file read, the paired results' table and the plan-accuracy reports drawn
from them."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gzip
import importlib.util
import inspect
import json
import os
import platform
import re
import subprocess
import sys

from benchlib import ROOT


@functools.cache
def trained_rule():
    """``thunder_fp8shard/testing/trained.py``'s :func:`trained` (which plans of a run trained, a step's totals) of
    this checkout, loaded by its path: the same rule whichever revision's pass ran (``thunder_litgpt.py
    --pythonpath`` puts another's package first on the path; the file imports nothing of the pass)."""
    path = os.path.join(ROOT, "thunder_fp8shard", "testing", "trained.py")
    spec = importlib.util.spec_from_file_location("_benchlib_trained", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.trained


def plan_summary(shard) -> dict | None:
    """What the pass did in the run: the plan of the training compilation, as plain data, with a step's totals
    over the plans that trained (:func:`trained_rule`; ``None``: no pass, or no plan); ``"replanned"`` counts the
    plans replanned after a missed budget, left out. Fields a plan of an older version of the pass may lack (another
    ``"revision"``, or ``thunder_litgpt.py --pythonpath``) are read with ``getattr``."""
    t = trained_rule()(shard.plans, getattr(shard, "reports", None)) if shard is not None else None
    if t is None:
        return None
    plan, total, runs = t.plan, t.total, list(t.runs)
    fp8 = [d for d in plan.decisions if d.kind in ("te_float8", "float8")]
    buckets = getattr(plan, "buckets", [])
    facts = run_facts(plan, t.report)
    predicted = facts["predicted"]  # the plan's prediction as the run-time audit corrected it
    return {
        "text": facts["text"], "world_size": plan.world_size, "integration": getattr(plan, "integration", None),
        # older versions of the pass shard over the whole group
        "shard_group_size": getattr(plan, "k", plan.world_size),
        "pass_seconds": getattr(plan, "pass_seconds", None),
        "pass_seconds_all_entries": sum(getattr(p, "pass_seconds", 0.0) for p in t.running),
        "candidates": len(plan.decisions), "sharded": len(plan.sharded),
        "buckets": len(buckets), "shard_ops": len({getattr(b, "shard_op", b.index) for b in buckets}),
        "bucket_members": [len(b.members) for b in buckets],
        "sharded_bytes": total(lambda p: sum(d.nbytes for d in p.sharded)),
        "fp8_weight_bytes": sum(d.nbytes for d in fp8 if d.replicated),
        "fp8_sharded_bytes": sum(d.nbytes for d in fp8 if d.sharded),
        "plans": len(t.plans), "runs_per_step": runs,
        "saved_bytes_before": plan.saved_bytes_before, "saved_bytes_after": plan.saved_bytes_after,
        "peak_bytes_before": plan.peak_bytes_before, "peak_bytes_after": predicted.peak_bytes_after,
        "peak_step_before": peak_where(getattr(plan, "timeline_before", None)),
        "peak_step_after": peak_where(getattr(predicted, "timeline_after", None)),
        "gathered_bytes_per_step": total(lambda p: getattr(p, "gathered_bytes_per_step", 0)),
        # fp8_forward_gather: the bytes each rank receives in the forward's all-gathers of TE linear weights a step,
        # (without, with) the option's decisions, and the weight elements it casts to FP8
        "forward_gather_bytes_per_step": [total(lambda p: getattr(p, "forward_gather_bytes", (0, 0))[i]) for i in (0, 1)],
        "forward_cast_elements_per_step": [total(lambda p: getattr(p, "forward_cast_elements", (0, 0))[i]) for i in (0, 1)],
        "saving_fraction": (plan.k - 1) / plan.k,
        "compactions": total(lambda p: len(getattr(p, "compacted", []))),
        "compacted_bytes": total(lambda p: getattr(p, "compacted_bytes_per_step", 0)),
        "compaction_freed_bytes": total(lambda p: sum(c.freed_bytes for c in getattr(p, "compacted", []))),
        "budget_bytes": getattr(plan, "budget_bytes", None), "budget_target_bytes": getattr(plan, "budget_target_bytes", None),
        "terms": [{"name": m.name, "source": m.source, "bytes": m.nbytes} for m in getattr(predicted, "terms", [])],
        "audit": facts["audit"], "calibration": facts["calibration"],
        "notes": list(getattr(plan, "notes", [])), "replanned": t.replanned,
    }


def run_facts(plan, report) -> dict:
    """What the run-time checks observed of ``plan`` (its run report), as plain data: ``audit`` and ``calibration``
    (dicts, None before they ran), ``runs_per_step``, ``predicted`` (the plan as the audit corrected it) and
    ``text`` (the plan with the checks' lines). ``report`` None: a plan of an older version of the pass, which kept
    these on the plan itself."""
    if report is None:
        return {"audit": getattr(plan, "audit", None), "calibration": getattr(plan, "calibration", None),
                "runs_per_step": getattr(plan, "runs_per_step", None), "predicted": plan, "text": str(plan)}
    from thunder_fp8shard.reporting.plan_text import plan_text

    as_dict = lambda r: dataclasses.asdict(r) if r is not None else None  # noqa: E731
    return {"audit": as_dict(report.saved), "calibration": as_dict(report.calibration),
            "runs_per_step": report.runs_per_step, "predicted": report.corrected(plan), "text": plan_text(plan, report)}


def peak_where(tl) -> dict | None:
    """The step of a memory timeline where it peaks: its phase, index and label."""
    if tl is None:
        return None
    s = tl.peak_step
    return {"phase": s.phase, "index": s.index, "label": getattr(s, "label", None)}


# ---- the command line: the script's own arguments, then Thunder's benchmark's flags after "--"; subcommands ----------


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(own, flags)``: the arguments before ``--`` (the script's) and after it (Thunder's benchmark's)."""
    if "--" not in argv:
        return argv, []
    return argv[: argv.index("--")], argv[argv.index("--") + 1 :]


def flag(flags: list[str], name: str, default=None):
    """The value of ``--name=value`` among ``flags`` (a string), or ``default``."""
    return next((f.split("=", 1)[1] for f in flags if f.startswith(f"--{name}=")), default)


def subcommands(doc: str):
    """A tool's parser, described by its module docstring ``doc`` (which lists the subcommands), and ``add(name, run)``:
    a subcommand described by ``run``'s docstring, run as ``args.run(args)`` (``add`` returns its parser)."""
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=doc, formatter_class=raw)
    commands = parser.add_subparsers(dest="command", required=True)

    def add(name: str, run) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, description=inspect.cleandoc(run.__doc__), formatter_class=raw)
        sub.set_defaults(run=run)
        return sub

    return parser, add


def load(path: str):
    """A JSON file, gzipped where its name ends in ``.gz``."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        return json.load(f)


# ---- the device ------------------------------------------------------------------------------------------------------


def nvidia_smi(query: str) -> str | None:
    """``nvidia-smi --query-gpu=<query>``'s answer, one line a GPU (None where it cannot run)."""
    try:
        return subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def device_name() -> str:
    """The first GPU's name and driver, or the CPU's name where there is no GPU."""
    gpus = nvidia_smi("name,driver_version")
    return gpus.splitlines()[0] if gpus else platform.processor() or "cpu"


# ---- the paired benchmark's results ----------------------------------------------------------------------------------


def results_table(results: list[dict]) -> str:
    """One row a comparison: the wall-time and CPU-issue overheads with their CIs, the base's median, the GB saved."""
    rows = ["arm vs base | wall overhead % [95% CI] | ms [CI] | CPU issue overhead % [CI] | base median ms | "
            "peak GB reduction"]
    for r in results:
        o, c = r["overhead_pct"], r["cpu_issue_overhead_pct"]
        rows.append(f"{r['arm']} vs {r['base']} | {o['median']:+.2f} [{o['ci95'][0]:+.2f}, {o['ci95'][1]:+.2f}] | "
                    f"{o['median_abs']:+.2f} [{o['ci95_abs'][0]:+.2f}, {o['ci95_abs'][1]:+.2f}] | "
                    f"{c['median']:+.2f} [{c['ci95'][0]:+.2f}, {c['ci95'][1]:+.2f}] | {o['base_median']:.2f} | "
                    f"{r['memory_reduction_GB']:.2f}")
    return "\n".join(rows)


SUBGRAPH_PLANS = "under ThunderFX"  # in a plan's integration name: one plan a subgraph (FSDP2 under ThunderFX)


def accuracy_reports(results: list[dict]) -> dict[str, dict]:
    """The plan's predicted peak against the measured one, one report a configuration (``"kind": "plan_accuracy"``;
    none under ThunderFX, where each plan sees one subgraph and none predicts the step's peak):
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
        own = arm.get("flags")  # a model of its own (paired.py's "flags"): its plan predicts no peak of the base's
        common["flags"] = own or r["flags"]
        common["executors"] = flag(common["flags"], "compile", "thunder")
        common["checkpoint_activations"] = flag(common["flags"], "checkpoint_activations", "False").lower() == "true"
        plan = arm["plan"]
        if not r["measured_peak_GB"]["base"]:  # the CPU: no device peak
            continue
        if SUBGRAPH_PLANS in (plan.get("integration") or ""):  # one plan a subgraph: none predicts the step's peak
            continue
        for name, with_pass, predicted, measured in (
                (r["arm"], True, plan["peak_bytes_after"], r["measured_peak_GB"]["arm"] * 1e9),
                (r["base"], False, plan["peak_bytes_before"], r["measured_peak_GB"]["base"] * 1e9)):
            if name in out or (own and not with_pass):
                continue
            out[name] = dict(common, kind="plan_accuracy", arm=name, with_pass=with_pass,
                             options=r["options"] if with_pass else None,
                             predicted_peak_bytes=int(predicted), measured_peak_bytes=int(measured),
                             error_pct=100.0 * (predicted - measured) / measured,
                             predicted_from=f"the plan of arm {r['arm']!r}" + (" (its peak after)" if with_pass
                                                                               else " (its peak before: no pass)"),
                             terms=plan["terms"], audit=plan["audit"], calibration=plan["calibration"])
    return out


def fill_regions(text: str, tag: str, contents: dict[str, str], names, page: str) -> str:
    """``text`` with each generated region ``<!-- TAG:NAME begin ... -->`` ... ``<!-- TAG:NAME end -->`` holding
    ``contents[NAME]`` (a region it lacks stays as it is); raises unless the page's regions are exactly ``names``."""
    region = re.compile(rf"(<!-- {tag}:(\w+) begin[^>]*-->\n)(.*?)(<!-- {tag}:\2 end -->)", re.S)
    found = [m.group(2) for m in region.finditer(text)]
    if sorted(found) != sorted(names):
        raise ValueError(f"{page}: generated regions {found}, expected {list(names)}")
    return region.sub(lambda m: m.group(1) + contents.get(m.group(2), m.group(3)) + m.group(4), text)
