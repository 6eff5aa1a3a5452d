"""Property test over generated small models (``thunder_fp8shard.testing.generated``): seeded random mixes of
linear layers, layer norms, expanded and viewed weights, straight-through FP8 copies and shared weights (and a
checkpointed mix), under Thunder FSDP ZeRO-3 and ZeRO-2, Thunder DDP and FSDP2 under ThunderFX, with
``candidates="fp8"``, ``"all"`` and the default ``"auto"``, on 2 gloo ranks. With the
pass: gradients bitwise those of the run without it (and non-zero), the bytes the plan says the forward saves (each
storage once) those measured, before and after, and the step's measured allocation peak never above the run
without it (the profiler's CPU allocation events: exact on the CPU, see the generator's docstring)."""

from dataclasses import replace

import pytest

from thunder_fp8shard.reporting.plan_text import verdict
from thunder_fp8shard.testing.generated import Case, run_case

pytestmark = pytest.mark.multirank

# seeds whose draws hold, between them, an expand, a weight used through a view, a shared weight and a layer norm;
# both kinds of candidates under ZeRO-3, the default under each setup (a compilation each: the test's time)
CASES = [Case.draw(5, "ZERO3"), replace(Case.draw(7, "ZERO2"), candidates=("auto",)),
         replace(Case.draw(1, "DDP"), candidates=("all", "auto")),
         # the default, with weights of 1 MiB (512 x 512 fp32): their shards are their parameter shards (under gloo the
         # model counts each all-gather's temporary, so here it never lowers the peak and stays gathered)
         replace(Case.draw(5, "ZERO3"), candidates=("auto",), d=512),
         replace(Case.draw(5, "FSDP2"), candidates=("auto", "all")),
         # checkpointed blocks: the default plans Thunder FSDP's collectives rescheduled too (reschedule=True)
         replace(Case.draw(3, "ZERO3"), layers=("checkpoint", "fp8", "checkpoint", "checkpoint", "checkpoint"),
                 candidates=("auto",), d=256)]


def _all_cases(rank, world_size, cases):
    return [run_case(rank, world_size, case) for case in cases]


def test_never_worse_and_exact_on_generated_models(on_ranks):
    results = on_ranks(_all_cases, 2, CASES)
    sharded = set()
    for rank, runs in enumerate(results):
        for case, run in zip(CASES, runs):
            base = run[None]
            for candidates in case.candidates:
                with_pass = run[candidates]
                where = f"rank {rank}, {case}, candidates={candidates!r}"
                assert len(with_pass["plans"]) == 1, where  # one program (under FSDP2: one Dynamo graph)
                plan = with_pass["plans"][0]
                assert base["grads"].keys() == with_pass["grads"].keys()
                for name, g in base["grads"].items():
                    assert g.abs().sum() > 0, f"{where}: the gradient of {name} is zero: the comparison is void"
                    assert g.equal(with_pass["grads"][name]), f"{where}: the gradient of {name} differs"
                assert (plan.saved_bytes_before, plan.saved_bytes_after) == (base["saved"], with_pass["saved"]), where
                assert plan.peak_bytes_after <= plan.peak_bytes_before, where
                assert with_pass["peak"] <= base["peak"], (where, base["peak"], with_pass["peak"], verdict(plan))
                assert all(d.bytes_saved > 0 for d in plan.sharded), where
                setup = case.setup + (" checkpointed" if "checkpoint" in case.layers else "")
                sharded |= {(setup, candidates, d.kind) for d in plan.sharded}
    # not vacuous: FP8 copies sharded under every setup (under DDP with candidates="all" too: its parameters' aliases
    # are left alone, the copies are not); and under the default, checkpointed blocks too
    assert {("ZERO3", "fp8", "float8"), ("ZERO3", "all", "float8"), ("ZERO2", "auto", "float8"),
            ("DDP", "all", "float8"), ("DDP", "auto", "float8"), ("ZERO3", "auto", "float8"),
            ("FSDP2", "auto", "float8"), ("FSDP2", "all", "float8"),
            ("ZERO3 checkpointed", "auto", "float8")} <= sharded, sharded
