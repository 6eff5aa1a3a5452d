"""The paired benchmark's schedule and statistics (pure; tested on the CPU): ABBA quads against the base arm, each
iteration of an arm paired with the base iteration beside it, the overhead as a median with a bootstrap CI over quads;
and the per-step CPU of the operators ``benchlib.op_timer`` timed, with the pass's share of it against the base."""

from __future__ import annotations

import numpy as np


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


# ---- the CPU of chosen operators a step (benchlib.op_timer), and the pass's share of it ----------------------------

PASS_PREFIX = "fp8shard"  # the pass's operators (and another revision's, fp8shard_rev_*)


def op_summary(iterations: list[dict]) -> dict:
    """Per operator over ``iterations`` (each ``name -> (calls, self wall ns[, self cpu ns])``): calls a step (mean),
    the thread's CPU ms a step (``ms``: mean, min, max; an iteration without the operator counts 0) and the wall ms
    a step (``wall_ms``; a wait for the device shows here). Without cpu ns the wall stands for both."""
    out = {}
    for name in sorted({n for it in iterations for n in it}):
        got = [it.get(name, (0, 0, 0)) for it in iterations]
        calls = [g[0] for g in got]
        wall = [g[1] / 1e6 for g in got]
        cpu = [(g[2] if len(g) > 2 else g[1]) / 1e6 for g in got]
        out[name] = {"calls": float(np.mean(calls)), "ms": float(np.mean(cpu)), "ms_min": min(cpu), "ms_max": max(cpu),
                     "wall_ms": float(np.mean(wall))}
    return out


def pass_cpu(base: dict, arm: dict, iterations: int) -> dict:
    """The CPU a step of ``arm`` spends on the timed operators, net of the base's (two :func:`op_summary` results):
    ``net_ms_per_step`` sums each operator's ms a step in the arm less the base's (the CPU the pass adds where it
    changed the program: its own operators, and Thunder's it replaced or left), ``gross_ms_per_step`` the pass's own
    operators' alone; ``by_operator`` both sides' calls and ms a step and the difference, largest first."""
    zero = {"calls": 0.0, "ms": 0.0}
    rows = []
    for name in sorted(set(base) | set(arm)):
        b, a = base.get(name, zero), arm.get(name, zero)
        rows.append({"operator": name, "pass": name.startswith(PASS_PREFIX), "arm_calls": a["calls"],
                     "arm_ms": a["ms"], "base_calls": b["calls"], "base_ms": b["ms"], "diff_ms": a["ms"] - b["ms"],
                     "diff_wall_ms": a.get("wall_ms", a["ms"]) - b.get("wall_ms", b["ms"])})
    rows.sort(key=lambda r: -abs(r["diff_ms"]))
    return {"net_ms_per_step": sum(r["diff_ms"] for r in rows),
            "net_wall_ms_per_step": sum(r["diff_wall_ms"] for r in rows),
            "gross_ms_per_step": sum(r["arm_ms"] for r in rows if r["pass"]), "iterations": iterations,
            "by_operator": rows}
