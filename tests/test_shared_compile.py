"""``paired.py --one-model`` (``benchmarks/benchlib/shared_compile.py``): an arm made a program of the base's compiled
model runs what the arm would have compiled with a model of its own (the same traces up to proxy names, the same
plan, bitwise the same gradients), and the arms' programs alternate on the one model."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

from benchlib import shared_compile  # noqa: E402
from plan_fingerprints import _plan_record, normalized  # noqa: E402

N_EMBD, N_HEAD, SEQ, BATCH = 64, 4, 32, 2


def _jit(transforms):
    import thunder

    from thunder_fp8shard.testing.executors import benchmark_executors
    from thunder_fp8shard.testing.toy_models import FakeFP8Llama

    torch.manual_seed(0)
    model = FakeFP8Llama(1, n_embd=N_EMBD, n_head=N_HEAD, rope=True)
    return model, thunder.jit(model, executors=benchmark_executors("cpu"), transforms=transforms)


def _grads(model, jm, seed: int) -> dict:
    idx = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))
    jm(idx).float().pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def _record(entry, shard) -> dict:
    return {"traces": [str(entry.computation_traces[-1]), str(entry.backward_traces[-1])],
            "plans": [_plan_record(p) for p in shard.plans]}


def test_an_arms_program_of_the_base_model_is_what_it_compiles_alone_and_alternates_with_the_base():
    import thunder

    from thunder_fp8shard import CompactSavedViews

    alone_pass = CompactSavedViews(optimizer_states=0)
    alone_model, alone = _jit([alone_pass])
    alone_grads = [_grads(alone_model, alone, 1)]  # compiled; its first-call checks still in (gone after step 2)

    model, jm = _jit([])
    base_grads = _grads(model, jm, 1)
    assert shared_compile.shareable(jm)
    base = shared_compile.entries(jm)
    arm_pass = CompactSavedViews(optimizer_states=0)
    arm, seconds = shared_compile.programs(jm, base, arm_pass)
    assert len(arm) == len(base) == 1 and seconds > 0
    assert normalized(_record(arm[0], arm_pass)) == normalized(_record(thunder.compile_stats(alone).interpreter_cache[0],
                                                                       alone_pass))
    alone_grads.append(_grads(alone_model, alone, 2))
    assert "fp8shard_compact" in str(arm[0].computation_traces[-1])
    assert "fp8shard_compact" not in str(base[0].computation_traces[-1])  # the base's own traces are untouched

    cs = thunder.compile_stats(jm)
    misses = cs.cache_misses
    runs = []
    for entries, seed in ((arm, 1), (base, 2), (arm, 2)):
        shared_compile.activate(jm, entries)
        assert not shared_compile.dropped(jm)
        runs.append(_grads(model, jm, seed))
    assert cs.cache_misses == misses  # nothing compiled: the programs ran
    assert arm_pass.reports[0].saved is not None  # the arm's own run-time check ran in the arm's program
    for got, want in ((runs[0], base_grads), (runs[0], alone_grads[0]), (runs[2], runs[1]), (runs[2], alone_grads[1])):
        for n in want:
            assert torch.equal(got[n], want[n]), n
            assert want[n].abs().sum() > 0, n
