"""testing/trained.py: which plans of a run trained and a step's totals, the one rule of the litgpt run, the
benchmarks' plan summary and the plan-accuracy tool."""

from types import SimpleNamespace

from thunder_fp8shard.testing.trained import trained


def _plan(decisions: int, compactions: int = 0, runs=None, missed=False):
    return SimpleNamespace(decisions=[object()] * decisions, compactions=[object()] * compactions, runs_per_step=runs,
                           calibration={"budget_missed": True} if missed else None)


def test_replanned_plans_are_left_out_and_totals_are_plan_times_runs():
    missed, big, small, idle = _plan(9, missed=True), _plan(3, 1, runs=4), _plan(1), _plan(0)
    t = trained([missed, big, small, idle])
    assert t.plan is big and t.plans == (big, small) and t.runs == (4, 1)
    assert t.running == (big, small, idle) and t.replanned == 1
    assert t.total(lambda p: len(p.decisions)) == 3 * 4 + 1


def test_no_plan_and_no_plan_that_trained():
    assert trained([]) is None
    idle = [_plan(0), _plan(0)]
    t = trained(idle)
    assert t.plan is idle[0] and t.plans == () and t.total(lambda p: 1) == 0
    every_missed = [_plan(2, missed=True)]  # nothing else runs: the missed plan is the one there is
    assert trained(every_missed).plan is every_missed[0]


def test_the_run_reports_say_what_the_checks_observed():
    """With run reports (this version of the pass), a missed budget and the runs a step are read from them, not from
    the plan."""
    from thunder_fp8shard.runtime.run_report import CalibrationReading, RunReport

    missed = CalibrationReading(measured_peak_bytes=2, own_peak_bytes=2, predicted_peak_bytes=1, error_bytes=1,
                                error_pct=100.0, at="step 2", budget_missed=True)
    plans = [_plan(9), _plan(3, 1), _plan(1)]
    reports = [RunReport(calibration=missed), RunReport(runs_per_step=4), RunReport()]
    t = trained(plans, reports)
    assert t.plan is plans[1] and t.report is reports[1] and t.replanned == 1
    assert t.plans == (plans[1], plans[2]) and t.runs == (4, 1)
    assert trained(plans).replanned == 0  # without the reports nothing says the first plan was replanned
