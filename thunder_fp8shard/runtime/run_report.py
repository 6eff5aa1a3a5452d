"""The run report: what the run-time checks of one compiled program observed against its plan, kept apart
from the plan, which is fixed at compile time. Only the checks write it, each field once.
"""

from __future__ import annotations

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
    start: int  # steps of the unmodified joint program
    end: int


@dataclass(frozen=True)
class SavedCheck:
    """The first call's audit: the distinct storages the forward saved against the model's."""

    measured_saved_bytes: int
    predicted_saved_bytes: int
    differences: tuple[Difference, ...]
    peak_bytes_after_at_compilation: int | None


@dataclass(frozen=True)
class CalibrationReading:
    """The device's peak at the calibration step (the largest over the shard group) against the corrected
    prediction: the plan's as the audit corrected it (``compiled_peak_bytes``) plus what the resident memory grew since
    compilation beyond the plan's terms (``resident_growth_bytes``: the optimizer's state where it was not given)."""

    measured_peak_bytes: int
    own_peak_bytes: int
    predicted_peak_bytes: int | None
    error_bytes: int | None  # measured - predicted
    error_pct: float | None
    at: str
    budget_missed: bool = False
    compiled_peak_bytes: int | None = None
    resident_growth_bytes: int | None = None  # None: not read (the CPU), or resident_bytes given
    total_bytes: int | None = None  # the device's
    memory_fraction: float | None = None  # of total_bytes this process may allocate
    reserved_peak_bytes: int | None = None  # this rank's allocator's (what the fraction limits)

    @property
    def capacity_bytes(self) -> int | None:
        return None if self.total_bytes is None else int(self.total_bytes * self.memory_fraction)


@dataclass
class RunReport:
    """What the run-time checks of one compiled program observed; empty until they run."""

    saved: SavedCheck | None = None
    # what the audit found, as measured terms, and the plan's timeline and peak after moved by them
    terms: tuple[MemoryTerm, ...] = ()
    timeline_after: Timeline | None = None
    peak_bytes_after: int | None = None
    calibration: CalibrationReading | None = None
    runs_per_step: int | None = None  # under ThunderFX one program can serve several blocks a step
    checks_removed: str | None = None

    def corrected(self, plan: ShardPlan) -> ShardPlan:
        """A new plan: ``plan``'s prediction with what the audit measured (``plan`` itself where nothing
        moved)."""
        if not self.terms:
            return plan
        return plan.replaced(
            terms=(*plan.terms, *self.terms),
            timeline_after=self.timeline_after if self.timeline_after is not None else plan.timeline_after,
            peak_bytes_after=self.peak_bytes_after if self.peak_bytes_after is not None else plan.peak_bytes_after)
