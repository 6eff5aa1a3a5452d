"""``reschedule`` (thunder_fp8shard.rewrite.collective_schedule): Thunder FSDP's forward all-gathers issued a few
ahead of their use and each gradient's reduce-scatter right after the gradient, on the CPU: the rewrite moves only
the order (the same bound symbols, every value made before its use), and on two gloo ranks a checkpointed model,
whose saved gathered weights Thunder's order keeps alive at once, trains bitwise as without the pass while the plan
takes the new order for a lower predicted peak and the saved bytes fall as planned; at N=8 simulated, sharding alone
leaves that model's predicted peak where it was, rescheduled it falls."""

from __future__ import annotations

import pytest

from thunder_fp8shard.analysis.names import ALL_GATHER, DIVIDE, REDUCE_SCATTER, WAIT
from thunder_fp8shard.analysis.program import program_facts
from thunder_fp8shard.rewrite import collective_schedule as cs
from thunder_fp8shard.testing.reference_run import RunConfig, mismatches, train_with_and_without


def _names(trace):
    return [b.sym.name for b in trace.bound_symbols if b.sym.name != "python_del"]


def _positions(trace, name):
    return [i for i, n in enumerate(_names(trace)) if n == name]


def test_the_schedules_move_only_the_order_of_fsdps_collectives(fsdp_traces):
    fw, bw, _ = fsdp_traces
    # Thunder's order: every all-gather before the first compute, every reduce-scatter after the last matmul
    assert max(_positions(fw, ALL_GATHER)) < _names(fw).index("abs")
    assert min(_positions(bw, REDUCE_SCATTER)) > max(_positions(bw, "matmul"))
    new_fw, new_bw = cs.schedule_forward(program_facts(fw, bw), prefetch=1), cs.schedule_backward(bw)
    assert new_fw is not None and new_bw is not None
    for old, new in ((fw, new_fw), (bw, new_bw)):
        assert sorted(_names(new)) == sorted(_names(old))  # the same bound symbols, dels made again
        made = {p.name for b in new.bound_symbols for p in b.flat_proxy_args} - {
            p.name for b in new.bound_symbols for p in b.flat_proxy_outs}
        for b in new.bound_symbols:
            if b.sym.name != "python_del":
                assert all(p.name in made for p in b.flat_proxy_args), b.sym.name
                made.update(p.name for p in b.flat_proxy_outs)
    # forward: each wait right before the weight's first use, each all-gather (but the first) one all-gather ahead
    names = _names(new_fw)
    assert max(_positions(new_fw, ALL_GATHER)) > names.index("abs")
    # backward: each reduce-scatter and its wait right after the division of a gradient made just before
    names = _names(new_bw)
    for i in _positions(new_bw, REDUCE_SCATTER):
        assert names[i - 1] == DIVIDE and names[i + 1] == WAIT
    assert min(_positions(new_bw, REDUCE_SCATTER)) < max(_positions(new_bw, "matmul"))
    # a function of the trace alone: every rank, given the same trace, makes the same order
    assert _names(cs.schedule_backward(bw)) == names


@pytest.mark.multirank
def test_a_checkpointed_model_rescheduled_is_exact_and_its_predicted_peak_falls(on_ranks):
    cfg = RunConfig(model="checkpointed", widths=(256,) * 9, batch_sizes=(2,), no_grad_call=False,
                    options={"candidates": "all", "min_bytes": 0, "reschedule": True})
    results = on_ranks(train_with_and_without, 2, cfg)
    for rank, (base, shard) in enumerate(results):
        assert mismatches(base, shard) == [], f"rank {rank}"
        assert all(g.abs().sum() > 0 for g in shard.grads[0].values())
        plan = shard.plans[0]
        notes = [n for n in plan.notes if n.startswith("reschedule:")]
        assert notes, plan.notes
        assert plan.peak_bytes_after < plan.peak_bytes_before
        assert any(d.sharded for d in plan.decisions)  # Thunder's order left every gathered weight unsharded here
        assert (plan.saved_bytes_before, plan.saved_bytes_after) == (base.saved_bytes[0], shard.saved_bytes[0])


@pytest.mark.simulated
def test_at_n8_sharding_lowers_the_checkpointed_peak_only_rescheduled():
    """Rank 0 of 8 under torch's fake process group (no gloo temporaries): in Thunder's order the saved gathered weights
    are sharded (the saved bytes fall) but the predicted peak does not move, held by the forward's gathered weights
    and the backward's unsharded gradients; rescheduled, the peak falls."""
    from thunder_fp8shard.testing.harness import run_simulated
    from thunder_fp8shard.testing.reference_run import train

    plans = {}
    for reschedule in (False, True):
        cfg = RunConfig(model="checkpointed", widths=(512,) * 9, batch_sizes=(2,), no_grad_call=False,
                        options={"candidates": "all", "min_bytes": 0, "reschedule": reschedule})
        run = run_simulated(train, 8, cfg)
        plans[reschedule] = plan = run.plans[0]
        assert plan.saved_bytes_after < plan.saved_bytes_before / 4 and run.saved_bytes[0] == plan.saved_bytes_after
    assert plans[False].peak_bytes_after == plans[False].peak_bytes_before
    assert plans[True].peak_bytes_after < 0.85 * plans[True].peak_bytes_before
    assert any(n.startswith("reschedule:") for n in plans[True].notes)
    assert not any(n.startswith("reschedule") for n in plans[False].notes)  # off: not planned, nothing to say


@pytest.mark.parametrize("reschedule", [False, True])
def test_the_rescheduled_variant_is_planned_only_with_the_option_on(single_rank_group, monkeypatch, reschedule):
    """Reschedule is a rewrite whose variant of the program the pipeline plans as a second program: with the option
    off nothing plans it (one planning pass a compilation), on it is planned beside Thunder's order (two)."""
    import thunder
    import torch
    from thunder.distributed import FSDPType
    from thunder.distributed.transforms.fsdp_v2 import FSDPTransform

    from thunder_fp8shard import ShardIntermediates, pipeline
    from thunder_fp8shard.testing.toy_models import CheckpointedBlocks

    passes = []
    planned = pipeline._planned
    monkeypatch.setattr(pipeline, "_planned", lambda *a, **k: passes.append(k.get("variant", "")) or planned(*a, **k))
    torch.manual_seed(0)
    shard = ShardIntermediates(candidates="all", min_bytes=0, reschedule=reschedule)
    fsdp = FSDPTransform(device=torch.device("cpu"), sharding_strategy=FSDPType.ZERO3)
    jm = thunder.jit(CheckpointedBlocks(64, 3), transforms=[fsdp, shard])
    jm(torch.randn(4, 64, requires_grad=True)).sum().backward()
    assert passes == (["", "reschedule"] if reschedule else [""])
