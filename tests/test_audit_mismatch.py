"""The first call's audit (``fp8shard_audit``, thunder_fp8shard.runtime.audit.SavedAudit) where the forward saves a
storage larger than the memory model said: the difference becomes a measured memory term on the steps the model
holds that storage, the predicted peak after rises by it, a warning names the tensor and both sizes, and later calls
change nothing."""

from __future__ import annotations

import warnings

import pytest
import torch

from thunder_fp8shard.plan import Step, Timeline
from thunder_fp8shard.plan import MEASURED, ShardPlan
from thunder_fp8shard.reporting.plan_text import plan_text
from thunder_fp8shard.runtime.audit import SAVED_TERM, TOLERANCE, SavedAudit, SavedStorage
from thunder_fp8shard.runtime.run_report import RunReport

STEPS = tuple(Step(i, "forward" if i < 4 else "backward", f"op{i}") for i in range(8))
LIVE = (100, 200, 300, 400, 400, 300, 200, 100)


def _plan() -> ShardPlan:
    timeline = Timeline(STEPS, LIVE, 4)
    return ShardPlan.of(world_size=2, method="slice", policy="all", prefetch=1, decisions=[], saved_bytes_before=0,
                     saved_bytes_after=0, peak_bytes_after=timeline.peak_bytes, timeline_after=timeline)


def test_a_storage_larger_than_modelled_becomes_a_measured_term_and_raises_the_predicted_peak():
    plan, report = _plan(), RunReport()
    modelled, measured = 1000, 1000 + 4 * TOLERANCE  # a difference over the tolerance
    expected = [SavedStorage("t_big", (0,), modelled, 2, 5), SavedStorage("t_ok", (1,), 64, 1, 6)]
    audit = SavedAudit(plan, report, expected, ["t_big", "t_ok"])
    saved = [torch.zeros(measured, dtype=torch.uint8), torch.zeros(16, dtype=torch.float32)]
    with pytest.warns(RuntimeWarning, match=r"t_big: 5,096 B measured, 1,000 B modelled"):
        audit(saved)
    assert report.saved.measured_saved_bytes == measured + 64
    assert report.saved.predicted_saved_bytes == modelled + 64
    assert report.saved.peak_bytes_after_at_compilation == 400
    (diff,) = report.saved.differences  # only the storage off by more than the tolerance
    assert (diff.storage, diff.tensors, diff.predicted, diff.measured) == ("t_big", ("t_big",), modelled, measured)
    (term,) = report.terms
    extra = measured - modelled
    assert (term.name, term.source, term.spans) == (SAVED_TERM, MEASURED, ((2, 5, extra),))
    # the timeline after moves by the term on the steps the storage is held, and the peak with it: in the report;
    # the plan stays as compiled
    assert report.timeline_after.live_bytes == tuple(b + (extra if 2 <= i <= 5 else 0) for i, b in enumerate(LIVE))
    assert report.peak_bytes_after == 400 + extra
    assert plan == _plan() and plan.terms == () and plan.peak_bytes_after == 400
    corrected = report.corrected(plan)
    assert corrected.terms == (term,) and corrected.peak_bytes_after == 400 + extra
    assert corrected.timeline_after is report.timeline_after
    text = plan_text(plan, report)
    assert "1 storage(s) differ" in text and "1 storage(s) differ" not in plan_text(plan)
    with warnings.catch_warnings():  # a later call compares nothing again
        warnings.simplefilter("error")
        audit([torch.zeros(2 * measured, dtype=torch.uint8), torch.zeros(16)])
    assert report.terms == (term,) and report.peak_bytes_after == 400 + extra and audit.calls == 2


def test_storages_within_the_tolerance_add_no_term():
    plan, report = _plan(), RunReport()
    audit = SavedAudit(plan, report, [SavedStorage("t0", (0,), 1000, 2, 5)], ["t0"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        audit([torch.zeros(1000 + TOLERANCE, dtype=torch.uint8)])
    assert report.saved.differences == () and report.terms == () and report.peak_bytes_after is None
    assert report.corrected(plan) is plan and plan.peak_bytes_after == 400
