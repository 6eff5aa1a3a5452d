"""Which plans of a run trained, and a step's totals over them (each plan's figure times its runs a step; plans
replanned after a missed budget left out). Pure and free of the pass's imports: benchmarks load it beside older
revisions, whose plans may lack fields."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Trained:
    """The plans of a run that trained."""

    plan: object  # a ShardPlan
    report: object  # None: an older version of the pass
    plans: tuple  # every plan with a decision or a compaction, in order, replanned ones left out
    runs: tuple[int, ...]  # each one's runs a step
    running: tuple  # every plan whose program runs, in order
    replanned: int  # plans replanned after the device missed their budget

    def total(self, figure: Callable[[object], float]) -> float:
        """A step's total of ``figure(plan)``: each training plan's, times its runs a step."""
        return sum(figure(p) * r for p, r in zip(self.plans, self.runs))


def _missed(plan, report) -> bool:
    if report is None:  # an older version of the pass kept the calibration on the plan
        return bool((getattr(plan, "calibration", None) or {}).get("budget_missed"))
    return bool(report.calibration is not None and report.calibration.budget_missed)


def _runs(plan, report) -> int:
    runs = getattr(plan, "runs_per_step", None) if report is None else report.runs_per_step
    return runs or 1


def trained(plans: Sequence, reports: Sequence | None = None) -> Trained | None:
    """The plans of a run (a transform's ``plans``, in order) that trained, with their run reports; None: no plan."""
    if not plans:
        return None
    report_of = {id(p): r for p, r in zip(plans, reports if reports is not None else [None] * len(plans))}
    running = [p for p in plans if not _missed(p, report_of[id(p)])] or list(plans)
    work = [p for p in running if p.decisions or getattr(p, "compactions", [])]
    plan = max(running, key=lambda p: len(p.decisions) + len(getattr(p, "compactions", [])))
    return Trained(plan, report_of[id(plan)], tuple(work), tuple(_runs(p, report_of[id(p)]) for p in work),
                   tuple(running), len(plans) - len(running))
