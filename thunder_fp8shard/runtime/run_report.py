"""The run report: what the run-time checks of one compiled program observed against its plan, kept apart from the
plan (which is fixed at compile time, :class:`~thunder_fp8shard.plan.ShardPlan`).

Only the checks write it (:class:`~thunder_fp8shard.runtime.audit.SavedAudit` at the first call,
:class:`~thunder_fp8shard.runtime.audit.Calibration` at the calibration step, and the latter's removal of both from
the program), each field once; it is empty until they run. The transform keeps one report per plan
(``ShardIntermediates.reports[i]`` is that of ``plans[i]``); :func:`thunder_fp8shard.reporting.plan_text.plan_text`
renders the two together.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from thunder_fp8shard.plan import MemoryTerm, ShardPlan

if TYPE_CHECKING:  # pragma: no cover
    from thunder_fp8shard.plan import Timeline


@dataclass(frozen=True)
class Difference:
    """A storage the forward saved whose measured bytes differ from the model's."""

    storage: str
    tensors: tuple[str, ...]
    predicted: int
    measured: int
    start: int  # the steps the model holds it (of the unmodified joint program)
    end: int


@dataclass(frozen=True)
class SavedCheck:
    """The first call's audit: the distinct storages the forward saved, measured, against the model's."""

    measured_saved_bytes: int
    predicted_saved_bytes: int
    differences: tuple[Difference, ...]  # the storages off by more than the audit's tolerance
    peak_bytes_after_at_compilation: int | None  # the plan's predicted peak after, before any correction


@dataclass(frozen=True)
class CalibrationReading:
    """The device's peak at the calibration step (the largest over the shard group) against the predicted peak
    (the plan's, as the audit corrected it)."""

    measured_peak_bytes: int
    own_peak_bytes: int  # this rank's reading
    predicted_peak_bytes: int | None
    error_bytes: int | None  # measured - predicted
    error_pct: float | None  # of the predicted
    at: str  # when it was read, in words
    budget_missed: bool = False  # policy "budget": over the budget, replanned at the next call


@dataclass
class RunReport:
    """What the run-time checks of one compiled program observed (empty until they run; each field written once, by
    the checks only)."""

    saved: SavedCheck | None = None  # the first call's audit of the saved storages
    # a difference the audit found, as a measured memory term, and the plan's timeline and peak after moved by it
    # (None: nothing moved)
    terms: tuple[MemoryTerm, ...] = ()
    timeline_after: Timeline | None = None
    peak_bytes_after: int | None = None
    calibration: CalibrationReading | None = None
    # the forward calls of this program in the first step, counted until its first backward: under ThunderFX one
    # program serves every block of the same class and shapes (None until the first backward)
    runs_per_step: int | None = None
    checks_removed: str | None = None  # when and how the first-call checks left the program (None: not yet)

    def corrected(self, plan: ShardPlan) -> ShardPlan:
        """``plan``'s prediction with what the audit measured: its terms, timeline after and peak after (``plan``
        itself where the audit moved nothing). The plan stays as compiled; this is a new one."""
        if not self.terms:
            return plan
        return dataclasses.replace(
            plan, terms=(*plan.terms, *self.terms),
            timeline_after=self.timeline_after if self.timeline_after is not None else plan.timeline_after,
            peak_bytes_after=self.peak_bytes_after if self.peak_bytes_after is not None else plan.peak_bytes_after)
