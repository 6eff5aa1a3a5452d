"""The steady state (``thunder_fp8shard.runtime.steady_state``): once the first-call checks are done (the audit at the first
call, the calibration at the first forward after the model's calibration step), the program runs without
them: the checks' implementations are not called again, the traces the first calls ran stay inspectable, and
gradients stay bitwise those of the run without the pass."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from thunder_fp8shard.testing.reference_run import RunConfig, mismatches, train

STEPS = 4  # the 2nd step's peak is read at the 3rd step's first forward: its backward drops the checks


def _counting(run):
    """``run()`` with the checks' implementations counted (each operator looks its function up at every call)."""
    from thunder_fp8shard.runtime import ops

    calls = {"audit": [], "calibrate": []}
    originals = ops._audit, ops._calibrate
    step = [0]

    def audit(saved, a):
        calls["audit"].append(step[0])
        return originals[0](saved, a)

    def calibrate(c):
        calls["calibrate"].append(step[0])
        return originals[1](c)

    ops._audit, ops._calibrate = audit, calibrate
    try:
        return run(step), calls
    finally:
        ops._audit, ops._calibrate = originals


@pytest.mark.unit
def test_compaction_alone_runs_without_the_checks_after_the_calibration_step():
    import thunder

    from thunder_fp8shard import CompactSavedViews
    from thunder_fp8shard.testing.executors import benchmark_executors
    from thunder_fp8shard.testing.toy_models import FakeFP8Llama

    def train_steps(step, transforms):
        torch.manual_seed(0)
        model = FakeFP8Llama(1, n_embd=32, n_head=4, rope=True)
        jm = thunder.jit(model, executors=benchmark_executors("cpu"), transforms=transforms)
        gen = torch.Generator().manual_seed(1)
        grads = []
        for s in range(STEPS):
            step[0] = s
            jm(torch.randint(0, 256, (2, 16), generator=gen)).float().pow(2).mean().backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            model.zero_grad(set_to_none=True)
        return grads, thunder.compile_stats(jm).interpreter_cache

    (base, _), _ = _counting(lambda step: train_steps(step, []))
    compact = CompactSavedViews(optimizer_states=0)
    (grads, cache), calls = _counting(lambda step: train_steps(step, [compact]))
    # the forward's audit and the backward's calibration run in the first three steps only
    assert calls == {"audit": [0, 1, 2], "calibrate": [0, 1, 2]}
    (plan,), (report,) = compact.plans, compact.reports
    assert report.checks_removed == "after backward call 3: the program's cache entry runs traces without them"
    assert plan.check_calls == {"fp8shard_audit": 1, "fp8shard_calibrate": 1}
    assert "fp8shard_audit" not in plan.operator_calls and sum(plan.operator_calls.values()) == 1  # one compaction
    text = compact.describe()
    assert "the first steps also call the first-call checks (1 fp8shard_audit, 1 fp8shard_calibrate)" in text
    assert f"first-call checks: {report.checks_removed}" in text
    # the traces: what runs now last, what the first calls ran before it
    (entry,) = cache
    fw_now, fw_first = entry.computation_traces[-1], entry.computation_traces[-2]
    bw_now, bw_first = entry.backward_traces[-1], entry.backward_traces[-2]
    names = lambda trace: [b.sym.name for b in trace.bound_symbols]  # noqa: E731
    assert "fp8shard_audit" in names(fw_first) and "fp8shard_audit" not in names(fw_now)
    assert "fp8shard_calibrate" in names(bw_first) and "fp8shard_calibrate" not in names(bw_now)
    assert "fp8shard_compact" in names(fw_now) and "steady state" in str(fw_now.get_provenance())
    assert len(fw_now.bound_symbols) == len(fw_first.bound_symbols) - 1
    assert len(bw_now.bound_symbols) == len(bw_first.bound_symbols) - 1
    for step, (a, b) in enumerate(zip(base, grads)):
        for n in a:
            assert torch.equal(a[n], b[n]), f"step {step}: gradient of {n} differs"
            assert a[n].abs().sum() > 0


def checked_run(rank, world_size, cfg):
    """On this rank: the run without the pass and the run with it, the checks' calls counted in the latter."""
    baseline = train(rank, world_size, replace(cfg, use_pass=False))
    run, calls = _counting(lambda step: train(rank, world_size, cfg))
    return baseline, run, {k: len(v) for k, v in calls.items()}


@pytest.mark.multirank
@pytest.mark.parametrize("api", ["transform", "fsdp2"])
def test_sharded_training_runs_without_the_checks_after_the_calibration_step(api, on_ranks):
    """Thunder FSDP ZeRO-3 (one program) and FSDP2 under ThunderFX (one program a subgraph): each program calls each
    check in the first three steps (the calibration reads the second's peak at the third's first forward), then runs
    without them, bitwise exact over the steps after."""
    cfg = RunConfig(widths=(25, 61, 47, 7), batch_sizes=(3,) * STEPS, no_grad_call=False, api=api,
                    options={"min_bytes": 0})
    for rank, (baseline, run, calls) in enumerate(on_ranks(checked_run, 2, cfg)):
        assert mismatches(baseline, run) == [], f"rank {rank}"
        assert all(g.abs().sum() > 0 for step in run.grads for g in step.values())
        plans = [(p, r) for p, r in zip(run.plans, run.reports) if p.decisions]
        assert plans and all(p.sharded for p, _ in plans)
        done = [r for _, r in plans if r.checks_removed is not None]
        assert done, "no program ran its calibration step"
        assert all(r.checks_removed.startswith("after backward call") and "without them" in r.checks_removed
                   for r in done)
        # each program calls each check in its runs of its first three steps only, then runs without them
        assert calls["audit"] == calls["calibrate"] == sum(3 * r.runs_per_step for r in done)
        if api == "transform":
            ((_, report),) = plans
            assert calls == {"audit": 3, "calibrate": 3} and report.checks_removed.startswith("after backward call 3:")
