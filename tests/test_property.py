"""Property test over generated small models (``thunder_fp8shard.testing.generated``): seeded random mixes of
linear layers, layer norms, expanded and viewed weights, straight-through FP8 copies and shared weights (and a
checkpointed mix), under Thunder FSDP ZeRO-3 and ZeRO-2, Thunder DDP and FSDP2 under ThunderFX, with
``candidates="fp8"``, ``"all"`` and the default ``"auto"``, on 2 gloo ranks. With the
pass: gradients bitwise those of the run without it (and non-zero), the bytes the plan says the forward saves (each
storage once) those measured, before and after, and the step's measured allocation peak never above the run
without it (the profiler's CPU allocation events: exact on the CPU, see the generator's docstring). And over
generated models trained with gradient accumulation: ``candidates="all"`` never predicts a higher peak than the default."""

import random
from dataclasses import replace

import pytest

from thunder_fp8shard.reporting.plan_text import verdict
from thunder_fp8shard.testing.generated import Case, plans_with_accumulation, run_case

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


def _floor_case(seed: int, setup: str) -> Case:
    """A drawn mix between a linear (an embedding) and an FP8 copy of its weight (a head tied to it), with a
    checkpointed block somewhere."""
    case, rng = Case.draw(seed, setup), random.Random(seed)
    layers = list(case.layers)
    layers.insert(rng.randrange(len(layers) + 1), "checkpoint")
    return replace(case, layers=("linear", *layers, "tied_fp8"), candidates=("auto", "all"), d=rng.choice((32, 64)),
                   batch=(2, rng.choice((4, 8))))


# the first model found where "all" shared nothing and the default an FP8 copy (the same predicted peak, less freed),
# then drawn ones: tied weights, checkpointed blocks and aliases (views, expands, shared weights) under each setup
FLOOR_CASES = [Case(0, "ZERO3", ("linear", "shared", "tied_fp8", "fp8"), candidates=("auto", "all"), batch=(2, 8)),
               *(_floor_case(seed, setup) for seed in (1, 2) for setup in ("ZERO3", "ZERO2", "DDP"))]


def _floor_plans(rank, world_size, cases):
    return [plans_with_accumulation(rank, world_size, case) for case in cases]


def test_all_candidates_never_predict_a_higher_peak_than_the_default(on_ranks):
    """``candidates="all"`` considers the default's candidates and more: with gradient accumulation (a program with
    and one without the gradients' reduction, DDP's the second left unsharded), every plan's predicted peak is at most
    the default's, it frees at least as much where the peaks are equal, and where it leaves out a tensor the default
    shards, its plan says why."""
    for rank, runs in enumerate(on_ranks(_floor_plans, 2, FLOOR_CASES)):
        for case, run in zip(FLOOR_CASES, runs):
            assert len(run["auto"]) == len(run["all"]) >= 1, case
            for default, every in zip(run["auto"], run["all"]):
                where = f"rank {rank}, {case}: {verdict(default)} / {verdict(every)}"
                assert every.peak_bytes_after <= default.peak_bytes_after, where
                if every.peak_bytes_after == default.peak_bytes_after:
                    assert every.saved_bytes_after <= default.saved_bytes_after, where
                left_out = {d.name for d in default.sharded} - {d.name for d in every.sharded}
                assert not left_out or any(n.startswith('candidates="all"') for n in every.notes), where
