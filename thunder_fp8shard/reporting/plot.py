"""Plots of live memory over the joint forward+backward program, before and after sharding."""

from __future__ import annotations

from collections.abc import Sequence
from os import PathLike
from typing import TYPE_CHECKING

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from thunder_fp8shard.plan import Timeline
from thunder_fp8shard.format import byte_unit
from thunder_fp8shard.reporting.plan_text import peak_words

if TYPE_CHECKING:  # pragma: no cover
    from thunder_fp8shard.plan import ShardPlan
    from thunder_fp8shard.runtime.run_report import RunReport


def plot_plan(plan: ShardPlan, path: str | PathLike | None = None, report: RunReport | None = None) -> Figure:
    """``plan``'s predicted memory timeline before and after (a matplotlib Figure; ``path`` saves a PNG).
    With ``report``, as the audit corrected it."""
    if report is not None:
        plan = report.corrected(plan)
    if plan.timeline_before is None:
        raise ValueError("this plan has no memory timeline (forward-only compile or nothing to model)")
    return plot_timelines(
        plan.timeline_before, plan.timeline_after, gathers=plan.gather_steps,
        title=f"ShardIntermediates: {len(plan.sharded)} tensors sharded 1/{plan.k}, {len(plan.compacted)} storages "
              f"compacted; predicted peak {peak_words(plan)}", path=path,
    )


def plot_timelines(
    before: Timeline,
    after: Timeline | None = None,
    *,
    gathers: Sequence[int] = (),
    title: str | None = None,
    path: str | PathLike | None = None,
) -> Figure:
    """Live bytes per step of ``before`` (and ``after``), marking the backward start, the peaks and the
    all-gathers at ``gathers``. ``path`` saves a PNG (Agg, no window).
    """
    timelines = {"before": before} | ({"after": after} if after is not None else {})
    unit, scale = byte_unit(max(t.peak_bytes for t in timelines.values()))
    fig = Figure(figsize=(10, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for k, ((name, t), color) in enumerate(zip(timelines.items(), ("tab:blue", "tab:orange"))):
        ax.plot(range(len(t.live_bytes)), [b / scale for b in t.live_bytes], drawstyle="steps-mid", color=color, label=name)
        peak = t.peak_step.index
        ax.plot([peak], [t.peak_bytes / scale], "v", color=color, markersize=9, label=f"peak {name}")
        ax.annotate(
            f"peak {t.peak_bytes / scale:.3g} {unit}\nstep {peak}: {t.peak_step.label}",
            (peak, t.peak_bytes / scale),
            xytext=(8, 8 - 26 * k),  # the second note below the first: peaks often share a step
            textcoords="offset points",
            fontsize=8,
            color=color,
        )
    ax.axvline(before.backward_start - 0.5, color="gray", linestyle="--", label="backward")
    if after is not None and after.backward_start != before.backward_start:
        ax.axvline(after.backward_start - 0.5, color="tab:orange", linestyle="--", label="backward (after)")
    if gathers:
        curve = timelines.get("after", before)
        ax.plot(gathers, [curve.live_bytes[g] / scale for g in gathers], "^", color="tab:green", label="all-gather")
    ax.set_xlabel("step (forward, then backward bound symbols)")
    ax.set_ylabel(f"live memory ({unit})")
    ax.set_ylim(0, 1.25 * max(t.peak_bytes for t in timelines.values()) / scale or 1)  # room for the notes
    ax.set_title(title or "live memory of the joint program")
    ax.legend(loc="lower center", ncols=3, fontsize=8)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, format="png", dpi=120)
    return fig
