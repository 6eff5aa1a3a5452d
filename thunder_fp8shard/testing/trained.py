"""Which plans of a run trained, and a step's totals over them: the one rule that the litgpt run
(:mod:`thunder_fp8shard.testing.litgpt_run`), the benchmarks' plan summary (``benchmarks/benchlib/reporting.py``) and
the plan-accuracy tool (``benchmarks/plan_accuracy.py``) read.

A transform keeps one plan a compilation. A plan whose budget the device missed was replanned: its program was
dropped and the replanned one runs instead, so it is left out. Under ThunderFX there is one plan a subgraph, and one
subgraph can run for several blocks (Dynamo reuses the graph of blocks of the same class): a step's totals are each
training plan's figure times its runs a step (counted at run time; 1 where not counted). The training compilation's
plan is the one with the most decisions and compactions (the first such).

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
    plans: tuple  # every plan with a decision or a compaction, in order (left out: replanned ones)
    runs: tuple[int, ...]  # each one's runs a step
    running: tuple  # every plan whose program runs, in order (all but the replanned ones)
    replanned: int  # plans left out: replanned after the device missed their budget

    def total(self, figure: Callable[[object], float]) -> float:
        """A step's total of ``figure(plan)``: each training plan's, times its runs a step."""
        return sum(figure(p) * r for p, r in zip(self.plans, self.runs))


def trained(plans: Sequence) -> Trained | None:
    """The plans of a run (a transform's ``plans``, in order of compilation) that trained; None: no plan."""
    if not plans:
        return None
    running = [p for p in plans if not (getattr(p, "calibration", None) or {}).get("budget_missed")] or list(plans)
    work = [p for p in running if p.decisions or getattr(p, "compactions", [])]
    plan = max(running, key=lambda p: len(p.decisions) + len(getattr(p, "compactions", [])))
    return Trained(plan, tuple(work), tuple(getattr(p, "runs_per_step", None) or 1 for p in work), tuple(running),
                   len(plans) - len(running))
