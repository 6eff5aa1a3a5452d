"""The plan is frozen once compiled; what the run-time checks observe goes to its run report
(``thunder_fp8shard.runtime.run_report``), and the plan's text renders the two together."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from thunder_fp8shard.plan import Step, Timeline
from thunder_fp8shard.memory.device import DeviceProbe
from thunder_fp8shard.memory.resident import OPTIMIZER, RESIDENT
from thunder_fp8shard.plan import GIVEN, MEASURED, MODELLED, UNKNOWN, Decision, MemoryTerm, ShardPlan
from thunder_fp8shard.reporting.plan_text import plan_text
from thunder_fp8shard.runtime.audit import CALIBRATION_AT, Calibration, SavedAudit, SavedStorage, StepClock
from thunder_fp8shard.runtime.run_report import RunReport

STEPS = tuple(Step(i, "forward" if i < 4 else "backward", f"op{i}") for i in range(8))
LIVE = (100, 200, 300, 400, 400, 300, 200, 100)


class Readings(DeviceProbe):
    """The device as a test plants it: the peak, the allocated bytes (one reading a call), the capacity."""

    def __init__(self, peak, allocated=(), capacity=None):
        self.peak, self.readings, self.cap = peak, list(allocated), capacity

    def peak_allocated(self, device):
        return self.peak

    def allocated(self, device):
        return self.readings.pop(0) if self.readings else None

    def capacity(self, device):
        return self.cap


def _plan(**fields) -> ShardPlan:
    timeline = Timeline(STEPS, LIVE, 4)
    d = Decision("w", (4,), "float8_e4m3fn", "float8", 64, True, True, "identical on every rank", shard_nbytes=32)
    return ShardPlan.of(world_size=2, method="slice", policy="all", prefetch=1, decisions=[d], saved_bytes_before=64,
                     saved_bytes_after=32, peak_bytes_before=400, peak_bytes_after=timeline.peak_bytes,
                     program_peak_bytes_before=400, program_peak_bytes_after=400, timeline_before=timeline,
                     timeline_after=timeline, terms=[MemoryTerm("loss", MODELLED, "rule", ((4, 4, 0),))], **fields)


def test_a_plan_is_frozen_and_holds_tuples():
    plan = _plan(notes=["a note"])
    assert isinstance(plan.decisions, tuple) and isinstance(plan.terms, tuple) and plan.notes == ("a note",)
    assert all(isinstance(getattr(plan, name), tuple)
               for name in ("decisions", "terms", "buckets", "agreed", "notes", "compactions", "forward_gather"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.peak_bytes_after = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.notes = ("another",)
    with pytest.raises(AttributeError):  # no append on a tuple
        plan.terms.append(MemoryTerm("x", MODELLED, ""))
    assert not any(hasattr(plan, f) for f in ("audit", "calibration", "runs_per_step", "checks_removed"))


def test_the_checks_write_the_report_and_leave_the_plan_as_compiled():
    """The audit finds a storage 2 KiB larger than modelled on steps 2-5, and the calibration reads the device's peak
    against the prediction as the audit corrected it; the plan is unchanged throughout."""
    plan, report = _plan(), RunReport()
    compiled = dataclasses.replace(plan)
    clock = StepClock()
    clock.agree = lambda mine: [mine[0] + 10, mine[1]]  # another rank read 10 B more
    audit = SavedAudit(plan, report, [SavedStorage("t0", (0,), 1000, 2, 5)], ["t0"], clock)
    misses = []
    calibration = Calibration(plan, report, "cuda:0", None, clock, on_miss=misses.append, audit=audit,
                              on_done=lambda: "dropped", probe=Readings(3000))
    with pytest.warns(RuntimeWarning, match="sized otherwise"):
        audit([torch.zeros(1000 + 2048, dtype=torch.uint8)])
    for step in range(3):  # two runs a step: two forwards, two backwards; the step after the calibration step's
        # first forward reads the largest over the ranks, its backward drops the checks
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(2 - (step == 0)):
                audit([torch.zeros(1, dtype=torch.uint8)])
            assert (report.calibration is not None) == (step == 2)
            for _ in range(2):
                calibration()
    assert plan == compiled and plan.peak_bytes_after == 400 and len(plan.terms) == 1
    assert report.saved.differences[0].measured - report.saved.differences[0].predicted == 2048
    assert report.peak_bytes_after == 400 + 2048 == report.corrected(plan).peak_bytes_after
    assert report.runs_per_step == 2 and report.checks_removed == "after backward call 5: dropped"
    c = report.calibration
    assert (c.measured_peak_bytes, c.own_peak_bytes, c.predicted_peak_bytes, c.error_bytes) == (3010, 3000, 2448, 562)
    assert not c.budget_missed and misses == []
    text = plan_text(plan, report)
    assert text.splitlines()[0] == plan_text(plan).splitlines()[0]  # the same plan
    assert "predicted peak per rank:     400 B -> 2.39 KiB (2,448 B)" in text  # the corrected prediction
    assert "predicted peak per rank:     400 B -> 400 B" in plan_text(plan)  # the plan's own
    assert f"calibration ({CALIBRATION_AT}): device peak 2.94 KiB (3,010 B), predicted 2.39 KiB (2,448 B)" in text
    assert "this program ran 2 times in the first step" in text and "first-call checks: after backward call 5" in text
    assert "calibration (" not in plan_text(plan) and "first-call checks:" not in plan_text(plan)


@pytest.mark.parametrize("resident, optimizer, unseen", [
    (MEASURED, None, 700),  # the optimizer's state unknown (no options): the whole growth is added
    (MEASURED, 500, 200),  # optimizer_states modelled 500 B of it
    (GIVEN, None, None),  # resident_bytes given: the caller's figure stands
])
def test_the_calibration_adds_what_the_resident_memory_grew_since_compilation(resident, optimizer, unseen):
    """The allocated bytes at the calibration step's first forward end less the first step's (700 B: the optimizer's
    state, made by the first optimizer step) correct the prediction, less what the plan modelled of it; the text gives
    the device's capacity (a cap set on the process) and the headroom at the peak."""
    terms = [MemoryTerm(RESIDENT, resident, "", ((0, 7, 50),)),
             MemoryTerm(OPTIMIZER, MODELLED if optimizer else UNKNOWN, "", ((0, 7, optimizer),) if optimizer else ())]
    plan, report, clock = _plan(), RunReport(), StepClock()
    plan = dataclasses.replace(plan, terms=tuple(terms))
    probe = Readings(1150, allocated=[300, 1000], capacity=(8000, 0.25, 1500))
    clock.allocated = lambda: probe.allocated("cuda:0")
    audit = SavedAudit(plan, report, [], [], clock)
    calibration = Calibration(plan, report, "cuda:0", None, clock, on_miss=None, audit=audit, probe=probe)
    for _ in range(3):
        audit([])
        calibration()
    c = report.calibration
    assert (c.compiled_peak_bytes, c.resident_growth_bytes, c.capacity_bytes) == (400, unseen, 2000)
    assert c.predicted_peak_bytes == 400 + (unseen or 0) and c.error_bytes == 1150 - c.predicted_peak_bytes
    text = plan_text(plan, report)
    if unseen == 700:
        assert (f"calibration ({CALIBRATION_AT}): device peak 1.12 KiB (1,150 B), predicted 1.07 KiB (1,100 B) = 400 B "
                "at compilation +700 B that the resident memory grew since beyond the plan's terms (the optimizer's "
                "state, unless optimizer_states said it), error +50 B (+4.55%)") in text
    assert ("capacity: 1.95 KiB (2,000 B), the cap set on this process (0.25 of the device's 7.81 KiB (8,000 B)); "
            "headroom at the peak 850 B allocated, 500 B reserved (the allocator's cache, which a cap limits: a step "
            "runs out of memory when it cannot grow)") in text
