"""Run-time checks of the plan, since the memory model is a prediction: the storages the forward really
saves, and the device's peak once a step has run with the optimizer's state. They write into the plan's
:class:`~thunder_fp8shard.runtime.run_report.RunReport`, so no gap stays silent:

- ``fp8shard_audit`` (before the forward's return) compares the saved storages with the model's at the first call;
  a difference becomes a measured term, with a warning. It also counts the forward's calls in the first step.
- ``fp8shard_calibrate`` (end of backward) reads the device's peak in the model's second step; the ranks agree on the
  largest (:class:`StepClock`). Under ``policy="budget"`` a reading over the budget warns and replans.
- The resident memory's growth since compilation (the optimizer's state, made after the first step) is the allocated
  bytes at the first forward's end of the calibration step less the first step's: the same program at the same point.
  The prediction corrected by it is what the calibration's error is measured against.

Neither synchronizes the device but for that one all-reduce; once done, both are removed
(:mod:`thunder_fp8shard.runtime.steady_state`).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from thunder_fp8shard.analysis.liveness import span_bytes
from thunder_fp8shard.memory.device import DeviceProbe
from thunder_fp8shard.memory.resident import OPTIMIZER, RESIDENT
from thunder_fp8shard.plan import GIVEN, MEASURED, MODELLED, MemoryTerm, ShardPlan
from thunder_fp8shard.runtime.run_report import CalibrationReading, Difference, RunReport, SavedCheck

SAVED_TERM = "saved storages at the first call"
CALIBRATION_TERM = "calibration"
CALIBRATION_STEP = 1  # from 0: the first step with the optimizer's state
CALIBRATION_AT = f"the largest at a backward's end in the model's step {CALIBRATION_STEP + 1}"
TOLERANCE = 1024  # bytes a storage may differ from the model's without a term (TE's scales)

# inner buffers of TE's quantized tensors (wrapper subclasses without a storage of their own)
_INNER_BUFFERS = ("_data", "_transpose", "_scale_inv", "_rowwise_data", "_columnwise_data", "_rowwise_scale_inv",
                  "_columnwise_scale_inv")


def storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages ``t`` keeps alive: its own, or a TE quantized tensor's inner buffers'."""
    if type(t) in (torch.Tensor, torch.nn.Parameter):
        return [t.untyped_storage()]
    inner = [getattr(t, a, None) for a in _INNER_BUFFERS]
    found = [s for b in inner if isinstance(b, torch.Tensor) for s in storages(b)]
    return found or [t.untyped_storage()]


@dataclass(frozen=True)
class SavedStorage:
    """One storage of the rewritten program's saved tensors, as the model has it."""

    name: str
    members: tuple[int, ...]  # positions in the saved list
    nbytes: int  # predicted
    start: int  # steps of the unmodified joint program
    end: int


def calibration_term(nbytes: int, last: int) -> MemoryTerm:
    """The error a missed budget measured, planned with from then on."""
    return MemoryTerm(CALIBRATION_TERM, MEASURED, f"the device peaked {nbytes:,} B over the prediction, {CALIBRATION_AT} "
                      "(policy budget, replanned)", ((0, last, nbytes),))


def compare(expected: list[SavedStorage], names: list[str], saved: list) -> tuple[int, list[Difference]]:
    """The measured bytes of the distinct storages of ``saved``, and the model's storages whose bytes differ by
    more than :data:`TOLERANCE`; each measured storage counts once."""
    seen: set[int] = set()
    total, differences = 0, []
    for e in expected:
        measured = 0
        for s in (s for k in e.members if isinstance(saved[k], torch.Tensor) for s in storages(saved[k])):
            if s._cdata not in seen:
                seen.add(s._cdata)
                measured += s.nbytes()
        total += measured
        if abs(measured - e.nbytes) > TOLERANCE:
            differences.append(Difference(e.name, tuple(names[k] for k in e.members), e.nbytes, measured, e.start,
                                          e.end))
    return total, differences


class SavedAudit:
    """``fp8shard_audit``'s state: compares the saved storages at the first call, and counts the forward's
    calls until the first backward."""

    def __init__(self, plan: ShardPlan, report: RunReport, expected: list[SavedStorage], names: list[str],
                 clock: StepClock | None = None):
        self.plan, self.report, self.expected, self.names, self.clock = plan, report, expected, names, clock
        self.done, self.counting, self.calls = False, True, 0

    def __call__(self, saved) -> None:
        if self.counting:
            self.calls += 1
        if self.clock is not None:
            self.clock.forward()
        if self.done:
            return
        self.done = True
        total, differences = compare(self.expected, self.names, list(saved))
        self.report.saved = SavedCheck(total, sum(e.nbytes for e in self.expected), tuple(differences),
                                       self.plan.peak_bytes_after)
        if differences:
            shown = "; ".join(f"{', '.join(d.tensors)}: {d.measured:,} B measured, {d.predicted:,} B modelled"
                              for d in differences[:4])
            shown += f"; and {len(differences) - 4} more" if len(differences) > 4 else ""
            spans = tuple((d.start, d.end, d.measured - d.predicted) for d in differences)
            report, t = self.report, self.plan.timeline_after
            report.terms = (*report.terms, MemoryTerm(SAVED_TERM, MEASURED,
                                                      f"saved storages the model sized otherwise ({shown})", spans))
            if t is not None:  # the plan's timeline and peak after, moved by the term (the plan stays as compiled)
                live = (span_bytes(spans, len(t.steps)) + t.live_bytes).tolist()
                report.timeline_after = type(t)(t.steps, tuple(live), t.backward_start)
                report.peak_bytes_after = report.timeline_after.peak_bytes
            warnings.warn(f"ShardIntermediates: the forward saves storages the memory model sized otherwise: {shown}; "
                          "the plan's predicted peak now counts them", RuntimeWarning, stacklevel=2)

    def __repr__(self) -> str:  # printed in the trace
        return f"SavedAudit({len(self.expected)} storages)"


class StepClock:
    """The model's steps as the first-call checks see them (one clock a transform): a step begins with the first
    forward after a backward. Every rank runs its steps together, so the calibration's all-reduce runs here, whichever
    program each rank compiled."""

    def __init__(self):
        self.reset()
        self.agree: Callable[[list[int]], list[int]] = list  # each value's largest over the ranks (set while compiling)
        self.allocated: Callable[[], int | None] = lambda: None  # the device's allocated bytes (set while compiling)
        self.on_backward: Callable[[], None] = lambda: None

    def reset(self) -> None:
        """From step 0 again (after a missed budget dropped every program)."""
        self.step, self.in_backward, self.done = 0, False, False
        self.reading: tuple[int, Calibration] | None = None
        self.at_forward_end: dict[int, int | None] = {}  # the allocated bytes at a step's first forward's end

    def forward(self) -> None:
        if self.in_backward:
            self.in_backward = False
            self.step += 1
        if self.step in (0, CALIBRATION_STEP) and self.step not in self.at_forward_end:
            self.at_forward_end[self.step] = self.allocated()
        if self.step > CALIBRATION_STEP and not self.done:
            self.done = True
            if self.reading is not None:  # alike on every rank (None on the CPU)
                mine, calibration = self.reading
                first, then = self.at_forward_end.get(0), self.at_forward_end.get(CALIBRATION_STEP)
                grown = None if first is None or then is None else then - first
                peak, agreed_growth = self.agree([mine, grown or 0])
                calibration.calibrate(mine, peak, None if grown is None else agreed_growth)

    def backward(self, calibration: Calibration, peak: int | None) -> None:
        if not self.in_backward:
            self.in_backward = True
            self.on_backward()
        if self.step == CALIBRATION_STEP and peak is not None and (self.reading is None or peak > self.reading[0]):
            self.reading = (peak, calibration)


class Calibration:
    """``fp8shard_calibrate``'s state: hands the :class:`StepClock` the device's peak at each backward's end;
    a missed budget calls ``on_miss(error_bytes)`` on every rank, and once done ``on_done()`` removes both checks.
    A plain class: Thunder prints a dataclass constant field by field."""

    def __init__(self, plan: ShardPlan, report: RunReport, device: str | None, budget_bytes: int | None,
                 clock: StepClock, on_miss: Callable[[int], None], audit: SavedAudit,
                 on_done: Callable[[], str | None] | None = None, probe: DeviceProbe = DeviceProbe()):
        self.plan, self.report, self.device, self.budget_bytes = plan, report, device, budget_bytes
        self.clock, self.on_miss, self.probe = clock, on_miss, probe
        self.audit, self.on_done, self.calls, self.done, self.missed = audit, on_done, 0, False, False

    def __call__(self) -> None:
        if self.done:
            return
        self.calls += 1
        if self.calls == 1:  # the first backward: the forward's calls so far are a step's
            self.audit.counting = False
            self.report.runs_per_step = max(self.audit.calls, 1)
        if self.clock.done:
            self.done = True
            if not self.missed:  # a missed budget dropped the program; else it runs without both checks from now on
                did = self.on_done() if self.on_done is not None else None
                self.report.checks_removed = (f"after backward call {self.calls}: {did}" if did else
                                              f"not removed after backward call {self.calls}: the program is not in "
                                              "Thunder's cache (or the pass was given no cache); both return at once")
            return
        self.clock.backward(self, self.probe.peak_allocated(self.device))

    def calibrate(self, mine: int, measured: int, growth: int | None = None) -> None:
        """Records the peak (``measured``: the largest over the ranks) against the prediction corrected by the resident
        memory's ``growth`` since compilation (the largest over the ranks; None: not read), and replans a missed
        budget."""
        plan = self.report.corrected(self.plan)
        compiled, unseen = plan.peak_bytes_after, unpredicted_growth(plan, growth)
        predicted = None if compiled is None else compiled + (unseen or 0)
        error = measured - predicted if predicted is not None else None
        missed = self.budget_bytes is not None and measured > self.budget_bytes
        total, fraction, reserved = self.probe.capacity(self.device) or (None, None, None)
        self.report.calibration = CalibrationReading(
            measured, mine, predicted, error, None if not predicted else 100.0 * error / predicted, CALIBRATION_AT,
            budget_missed=missed, compiled_peak_bytes=compiled, resident_growth_bytes=unseen, total_bytes=total,
            memory_fraction=fraction, reserved_peak_bytes=reserved)
        if missed:
            self.missed = True
            warnings.warn(
                f"ShardIntermediates: the device peaked at {measured:,} B, over the budget {self.budget_bytes:,} B "
                f"(predicted {predicted:,} B): the next call recompiles and plans with the {error:,} B error as a "
                "measured term", RuntimeWarning, stacklevel=3)
            self.on_miss(error)

    def __repr__(self) -> str:
        return f"Calibration(step {CALIBRATION_STEP})"


def unpredicted_growth(plan: ShardPlan, growth: int | None) -> int | None:
    """What the prediction lacks of the resident memory's ``growth`` since compilation: the growth less the optimizer
    state the plan modelled (``optimizer_states``); None where not read, or the resident memory was given
    (``resident_bytes``: the caller's figure stands)."""
    terms = {t.name: t for t in plan.terms}
    if growth is None or RESIDENT not in terms or terms[RESIDENT].source == GIVEN:
        return None
    modelled = terms[OPTIMIZER].nbytes if OPTIMIZER in terms and terms[OPTIMIZER].source == MODELLED else 0
    return growth - modelled


def cache_dropper(compile_stats) -> Callable[[], None]:
    """A function dropping every compiled program of Thunder's cache, so that the next call compiles
    again."""
    ref = weakref.ref(compile_stats) if compile_stats is not None else None

    def drop() -> None:
        cs = ref() if ref is not None else None
        if cs is not None:
            cs.interpreter_cache.clear()

    return drop
