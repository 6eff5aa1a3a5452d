"""Which plans of a run trained, and a step's totals over them: the one rule that the litgpt run
(:mod:`thunder_fp8shard.testing.litgpt_run`), the benchmarks' plan summary (``benchmarks/benchlib/reporting.py``) and
the plan-accuracy tool (``benchmarks/plan_accuracy.py``) read.

A transform keeps one plan a compilation. A plan whose budget the device missed was replanned: its program was
dropped and the replanned one runs instead, so it is left out. Under ThunderFX there is one plan a subgraph, and one
subgraph can run for several blocks (Dynamo reuses the graph of blocks of the same class): a step's totals are each
training plan's figure times its runs a step (counted at run time; 1 where not counted). The training compilation's
plan is the one with the most decisions and compactions (the first such). What the run-time checks observed (a
missed budget, the runs a step) is read from each plan's run report (``ShardIntermediates.reports[i]``, a
:class:`~thunder_fp8shard.runtime.run_report.RunReport`); a plan of an older version of the pass, which has no
reports, kept them on the plan itself.

Pure over the plans, and it imports nothing of the pass: the benchmarks load this file by its path, beside whichever
revision's pass ran, whose plans may lack fields (read with ``getattr``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Trained:
    """The plans of a run that trained."""

    plan: object  # the training compilation's plan (a ShardPlan)
    report: object  # its run report (None: an older version of the pass, no reports)
    plans: tuple  # every plan with a decision or a compaction, in order (left out: replanned ones)
    runs: tuple[int, ...]  # each one's runs a step
    running: tuple  # every plan whose program runs, in order (all but the replanned ones)
    replanned: int  # plans left out: replanned after the device missed their budget

    def total(self, figure: Callable[[object], float]) -> float:
        """A step's total of ``figure(plan)``: each training plan's, times its runs a step."""
        return sum(figure(p) * r for p, r in zip(self.plans, self.runs))


def _missed(plan, report) -> bool:
    if report is None:  # an older version of the pass: the plan kept the calibration, as a dict
        return bool((getattr(plan, "calibration", None) or {}).get("budget_missed"))
    return bool(report.calibration is not None and report.calibration.budget_missed)


def _runs(plan, report) -> int:
    runs = getattr(plan, "runs_per_step", None) if report is None else report.runs_per_step
    return runs or 1


def trained(plans: Sequence, reports: Sequence | None = None) -> Trained | None:
    """The plans of a run (a transform's ``plans``, in order of compilation) that trained, with their run reports
    (the transform's ``reports``, one a plan; None: an older version of the pass); None: no plan."""
    if not plans:
        return None
    report_of = {id(p): r for p, r in zip(plans, reports if reports is not None else [None] * len(plans))}
    running = [p for p in plans if not _missed(p, report_of[id(p)])] or list(plans)
    work = [p for p in running if p.decisions or getattr(p, "compactions", [])]
    plan = max(running, key=lambda p: len(p.decisions) + len(getattr(p, "compactions", [])))
    return Trained(plan, report_of[id(plan)], tuple(work), tuple(_runs(p, report_of[id(p)]) for p in work),
                   tuple(running), len(plans) - len(running))
