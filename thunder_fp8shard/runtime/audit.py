"""What the pass checks at run time against its plan: the storages the forward really saves (at the first call), and
the device's peak once a step has run with the optimizer's state (calibration).

The memory model is a prediction: a fusion region that aliases differently than its replay on meta tensors said, an
executor not modelled, the allocator's rounding. Two run-time operators, inserted by the rewrite, compare the
prediction with the device and write what they find into the plan's run report
(:class:`~thunder_fp8shard.runtime.run_report.RunReport`: ``saved`` and ``calibration``; the plan itself stays as
compiled), so that no gap stays silent:

- ``fp8shard_audit`` (the forward's last operator, before its return) looks, at the first call, at the distinct
  storages of the tensors the forward saves (as ``torch.autograd.graph.saved_tensors_hooks`` would count them, the
  buffers of TransformerEngine's quantized tensors included) and compares them, storage by storage, with the model's.
  A difference becomes a *measured* memory term of the report (``saved storages at the first call``), on the steps
  the model has those tensors alive, with a warning naming the tensors and their bytes; the report's predicted peak
  after is the plan's corrected by it (``RunReport.corrected(plan)``). Later calls return at once.
- ``fp8shard_audit`` also counts the forward's calls until the program's first backward: the report's
  ``runs_per_step`` (under ThunderFX one compiled program serves every block of the same class and shapes, so its
  plan runs several times a step; its bytes count that many times).
- ``fp8shard_calibrate`` (the backward's last operator) reads the device's peak (``torch.cuda.max_memory_allocated``)
  at each backward's end of the model's second step: the first whose forward and backward run with the optimizer's
  state (it is created by the first ``optimizer.step()``), and whose peak Thunder's benchmark and most loops do not
  reset. The ranks agree on the largest reading (one all-reduce MAX, once), so that every rank decides alike; the
  all-reduce runs where every rank is at the same point whatever program it compiled: at the end of the first
  forward of the next step (:class:`StepClock`). The report records the reading and its error against the predicted
  peak. Under ``policy="budget"``, a reading over the budget is a warning, and the pass plans the next compilation
  with the error as a measured term (``calibration``) and forces that compilation at the next call (it drops the
  compiled programs from Thunder's cache: the cost is one recompilation, on every rank alike); the user sees both in
  the new plan. On the CPU nothing is read.

Both read only metadata or one counter: no device synchronization, except the calibration's one all-reduce. Once
the calibration is done (and no budget was missed), both are removed from the program
(:mod:`thunder_fp8shard.runtime.steady_state`): the steady-state step does not call them.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from thunder_fp8shard.analysis.liveness import span_bytes
from thunder_fp8shard.memory.device import peak_allocated
from thunder_fp8shard.plan import MEASURED, MemoryTerm, ShardPlan
from thunder_fp8shard.runtime.run_report import CalibrationReading, Difference, RunReport, SavedCheck


log = logging.getLogger(__name__)

SAVED_TERM = "saved storages at the first call"
CALIBRATION_TERM = "calibration"
CALIBRATION_STEP = 1  # the model's step whose peak is read (from 0): the first with the optimizer's state
CALIBRATION_AT = f"the largest at a backward's end in the model's step {CALIBRATION_STEP + 1}"
TOLERANCE = 1024  # bytes a storage may differ from the model's without a term (TE's 4-byte scales, ...)

# inner buffers of TransformerEngine's quantized tensors (wrapper subclasses without a storage of their own)
_INNER_BUFFERS = ("_data", "_transpose", "_scale_inv", "_rowwise_data", "_columnwise_data", "_rowwise_scale_inv",
                  "_columnwise_scale_inv")


def storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages ``t`` keeps alive: its own, or for a TransformerEngine quantized tensor its inner buffers'."""
    if type(t) in (torch.Tensor, torch.nn.Parameter):
        return [t.untyped_storage()]
    inner = [getattr(t, a, None) for a in _INNER_BUFFERS]
    found = [s for b in inner if isinstance(b, torch.Tensor) for s in storages(b)]
    return found or [t.untyped_storage()]


@dataclass(frozen=True)
class SavedStorage:
    """One storage of the rewritten program's saved tensors, as the model has it."""

    name: str  # the model's name of the storage
    members: tuple[int, ...]  # positions of its tensors in the saved list
    nbytes: int  # predicted bytes
    start: int  # the steps the model holds it (of the unmodified joint program)
    end: int


def calibration_term(nbytes: int, last: int) -> MemoryTerm:
    """The error a missed budget measured, planned with from then on (every step)."""
    return MemoryTerm(CALIBRATION_TERM, MEASURED, f"the device peaked {nbytes:,} B over the prediction, {CALIBRATION_AT} "
                      "(policy budget, replanned)", ((0, last, nbytes),))


def compare(expected: list[SavedStorage], names: list[str], saved: list) -> tuple[int, list[Difference]]:
    """The measured bytes of the distinct storages of ``saved`` (the tensors of the saved list, ``names`` theirs),
    and the model's storages whose bytes differ by more than :data:`TOLERANCE`: each measured storage counts once,
    for the first model storage that reaches it (pure but for reading the tensors' storages)."""
    seen: set[int] = set()
    total, differences = 0, []
    for e in expected:
        measured = 0
        for k in e.members:
            t = saved[k]
            if not isinstance(t, torch.Tensor):
                continue
            for s in storages(t):
                key = s._cdata
                if key not in seen:
                    seen.add(key)
                    measured += s.nbytes()
        total += measured
        if abs(measured - e.nbytes) > TOLERANCE:
            differences.append(Difference(e.name, tuple(names[k] for k in e.members), e.nbytes, measured, e.start,
                                          e.end))
    return total, differences


def saved_term(differences: list[Difference]) -> MemoryTerm:
    shown = "; ".join(f"{', '.join(d.tensors)}: {d.measured:,} B measured, {d.predicted:,} B modelled"
                      for d in differences[:4])
    more = f"; and {len(differences) - 4} more" if len(differences) > 4 else ""
    return MemoryTerm(SAVED_TERM, MEASURED, f"saved storages the model sized otherwise ({shown}{more})",
                      tuple((d.start, d.end, d.measured - d.predicted) for d in differences))


def add_term(report: RunReport, plan: ShardPlan, term: MemoryTerm) -> None:
    """``term`` into the report's terms, and ``plan``'s timeline and predicted peak after moved by its bytes into
    the report (the plan stays as compiled)."""
    report.terms = (*report.terms, term)
    t = plan.timeline_after
    if t is None or not term.spans:
        return
    live = (span_bytes([(s, e, b) for s, e, b in term.spans], len(t.steps)) + t.live_bytes).tolist()
    report.timeline_after = type(t)(t.steps, tuple(live), t.backward_start)
    report.peak_bytes_after = report.timeline_after.peak_bytes


class SavedAudit:
    """The forward's check of what it saves (``fp8shard_audit``'s state): at the first call, compares and records
    into ``report``; until the program's first backward, counts the forward's calls (``calls``: under ThunderFX one
    compiled program can serve several blocks of a step). ``plan``: the prediction it checks (read only)."""

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
            term = saved_term(differences)
            add_term(self.report, self.plan, term)
            warnings.warn(f"ShardIntermediates: the forward saves storages the memory model sized otherwise: "
                          f"{term.how.split('(', 1)[1].rstrip(')')}; the plan's predicted peak now counts them",
                          RuntimeWarning, stacklevel=2)

    def __repr__(self) -> str:  # printed in the trace
        return f"SavedAudit({len(self.expected)} storages)"


class StepClock:
    """The model's steps as the first-call checks of its programs see them (one clock a transform): a step begins
    with the first forward after a backward, whichever program each rank compiled for it. Every rank runs its steps
    together, so the clock is where a collective may run at run time: the calibration's one all-reduce, at the end of
    the first forward of the step after :data:`CALIBRATION_STEP`. Its first backward ends the ranks' compiling
    together (``on_backward``: from then on a rank may compile a shape of its own, alone)."""

    def __init__(self):
        self.reset()
        self.agree: Callable[[int], int] = lambda mine: mine  # the largest reading over the ranks (set while compiling)
        self.on_backward: Callable[[], None] = lambda: None

    def reset(self) -> None:
        """From step 0 again (a missed budget dropped every program: the new ones calibrate anew)."""
        self.step, self.in_backward, self.done = 0, False, False
        self.reading: tuple[int, Calibration] | None = None  # this rank's largest peak in the calibration step

    def forward(self) -> None:
        if not self.in_backward:
            return
        self.in_backward = False
        self.step += 1
        if self.step > CALIBRATION_STEP and not self.done:
            self.done = True
            if self.reading is not None:  # every rank alike: a device was read (none on the CPU)
                mine, calibration = self.reading
                calibration.calibrate(mine, self.agree(mine))

    def backward(self, calibration: Calibration, peak: int | None) -> None:
        if not self.in_backward:
            self.in_backward = True
            self.on_backward()
        if self.step == CALIBRATION_STEP and peak is not None and (self.reading is None or peak > self.reading[0]):
            self.reading = (peak, calibration)


class Calibration:
    """The backward's check of the device's peak (``fp8shard_calibrate``'s state): it hands the model's
    :class:`StepClock` the device's peak (``peak(device)``, :meth:`~thunder_fp8shard.memory.device.DeviceProbe.peak_allocated`;
    None on the CPU) at each backward's end, and the clock has the program whose reading was the largest in the
    calibration step record it (:meth:`calibrate`, with the largest over the ranks), compare it with ``plan``'s
    prediction as the audit corrected it and, where ``budget_bytes`` is missed, call ``on_miss(error_bytes)`` on
    every rank alike. Once the clock is done, the next backward calls ``on_done()`` (it removes both checks from the
    program and says how, :func:`thunder_fp8shard.runtime.steady_state.checks_dropper`). (A plain class: Thunder
    prints a dataclass constant in the trace field by field.)"""

    def __init__(self, plan: ShardPlan, report: RunReport, device: str | None, budget_bytes: int | None,
                 clock: StepClock, on_miss: Callable[[int], None], audit: SavedAudit,
                 on_done: Callable[[], str | None] | None = None,
                 peak: Callable[[str | None], int | None] = peak_allocated):
        self.plan, self.report, self.device, self.budget_bytes = plan, report, device, budget_bytes
        self.clock, self.on_miss, self.peak = clock, on_miss, peak
        self.audit, self.on_done, self.calls, self.done, self.missed = audit, on_done, 0, False, False

    def __call__(self) -> None:
        if self.done:
            return
        self.calls += 1
        if self.calls == 1:  # the program's first backward: its forward ran this many times in the first step
            self.audit.counting = False
            self.report.runs_per_step = max(self.audit.calls, 1)
        if self.clock.done:
            self.done = True
            if not self.missed:  # a missed budget dropped the program: nothing left to run without the checks
                self._finish()
            return
        self.clock.backward(self, self.peak(self.device))

    def _finish(self) -> None:
        """Both checks are done: the program runs without them from the next call on (``on_done``)."""
        did = self.on_done() if self.on_done is not None else None
        self.report.checks_removed = (f"after backward call {self.calls}: {did}" if did else
                                      f"not removed after backward call {self.calls}: the program is not in "
                                      "Thunder's cache (or the pass was given no cache); both return at once")

    def calibrate(self, mine: int, measured: int) -> None:
        """Records the device's peak (``measured``: the largest over the ranks; ``mine``: this rank's) and replans a
        missed budget."""
        predicted = self.report.corrected(self.plan).peak_bytes_after
        error = measured - predicted if predicted is not None else None
        missed = self.budget_bytes is not None and measured > self.budget_bytes
        self.report.calibration = CalibrationReading(measured, mine, predicted, error,
                                                     None if not predicted else 100.0 * error / predicted,
                                                     CALIBRATION_AT, budget_missed=missed)
        if missed:
            self.missed = True
            warnings.warn(
                f"ShardIntermediates: the device peaked at {measured:,} B, over the budget {self.budget_bytes:,} B "
                f"(predicted {predicted:,} B): the next call recompiles and plans with the {error:,} B error as a "
                "measured term", RuntimeWarning, stacklevel=3)
            self.on_miss(error)

    def __repr__(self) -> str:
        return f"Calibration(step {CALIBRATION_STEP})"


def cache_dropper(compile_stats) -> Callable[[], None]:
    """A function dropping every compiled program of Thunder's cache (``compile_stats`` held weakly), so that the next
    call compiles again."""
    ref = weakref.ref(compile_stats) if compile_stats is not None else None

    def drop() -> None:
        cs = ref() if ref is not None else None
        if cs is not None:
            cs.interpreter_cache.clear()

    return drop
