"""Ranks that compile different programs (issue #44): a short last batch or dynamic padding gives a rank input shapes
of its own at some step, and Thunder compiles that rank's program alone, at that step. With the pass the model still
trains bitwise as without it, in every setup, whether the shapes differ at the first step or later: every later
compilation realizes the layout the ranks agreed at the first one, with no collective
(:mod:`thunder_fp8shard.distributed.layout`). Where a rank's program cannot run the agreed collectives, that rank
raises before running it, and the others get an error instead of a hang; a rank that fails in the middle of a step
leaves the others as they are without the pass. Real gloo processes, different data on every rank."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from thunder_fp8shard.testing.reference_run import RunConfig, mismatches, train_with_and_without

pytestmark = pytest.mark.multirank
LATER = ((4, 4, 3, 4, 4), (4, 2, 4, 4, 2))  # rank 1 compiles a shape of its own at step 1, rank 0 at step 2
FIRST = ((3, 5, 3), (5, 3, 5))  # different shapes from the first step on
SEQ = (((2, 16), (2, 16), (2, 12), (2, 16)), ((2, 16), (2, 10), (2, 16), (2, 10)))  # per-rank sequence lengths
MLP = dict(widths=(25, 61, 47, 7), no_grad_call=False, options={"min_bytes": 0})
SETUPS = {
    "zero3": RunConfig(**MLP, rank_batch_sizes=LATER),
    "zero3-first-step": RunConfig(**MLP, rank_batch_sizes=FIRST),
    "zero2": RunConfig(**MLP, rank_batch_sizes=LATER, sharding_strategy="ZERO2"),
    "ddp": RunConfig(**MLP, rank_batch_sizes=LATER, api="ddp"),
    "fsdp2": RunConfig(**MLP, rank_batch_sizes=LATER, api="fsdp2"),
    "zero3-sequence-lengths": RunConfig(**MLP, rank_batch_sizes=SEQ, model="llama"),
    "fsdp2-sequence-lengths": RunConfig(**MLP, rank_batch_sizes=SEQ, model="llama", api="fsdp2"),
}
BOUND_S = 300  # a run that would hang fails here instead


# make test runs the first (docs/testing.md); make test-all every one
@pytest.mark.parametrize("setup", [pytest.param(s, marks=pytest.mark.setup_exactness("rank_shapes")) if s == "zero3" else s
                                   for s in SETUPS])
def test_ranks_that_compile_their_own_shapes_train_exactly(setup, on_ranks):
    cfg = SETUPS[setup]
    results = on_ranks(train_with_and_without, 2, cfg, timeout_s=BOUND_S)
    sharded = []
    for rank, (base, run) in enumerate(results):
        assert len(run.losses) == len(cfg.batches_of(rank))
        assert mismatches(base, run) == [], f"rank {rank}"
        assert all(g.abs().sum() > 0 for step in run.grads for g in step.values()), f"rank {rank}: a zero gradient"
        plans = [p for p in run.plans if p.decisions]
        alone = [p for p in plans if any("compiled on this rank alone" in n for n in p.notes)]
        assert alone, f"rank {rank}: no program was compiled alone"  # the shapes did differ
        sharded.append(sorted(len(p.sharded) for p in plans))
        assert all(len(p.sharded) > 0 for p in plans), f"rank {rank}: {[len(p.sharded) for p in plans]}"
        # a program compiled alone gathers what a program compiled together did (under ThunderFX, one per layer)
        together = {tuple(b.gathered_nbytes for b in p.buckets) for p in plans if p not in alone}
        assert all(tuple(b.gathered_nbytes for b in p.buckets) in together for p in alone), f"rank {rank}"
    assert not torch.equal(results[0][0].losses[0], results[1][0].losses[0])  # the ranks saw different data


# ---- a program that cannot run the agreed collectives ----------------------------------------------------------------


class ShapeBranch(torch.nn.Module):
    """A model whose code path depends on the batch size: above 4 rows its second layer computes with an FP8 copy
    of its weight (saved for backward, sharded by the pass), below with the weight itself. A rank whose batch takes
    the other path compiles a program without that copy: the agreed layout cannot be realized there."""

    def __init__(self):
        super().__init__()
        from thunder_fp8shard.testing.toy_models import FakeFP8Linear

        self.a, self.b = FakeFP8Linear(24, 64), FakeFP8Linear(64, 8)

    def forward(self, x):
        from thunder_fp8shard.testing.toy_models import fake_fp8_linear

        h = torch.nn.functional.gelu(fake_fp8_linear(x, self.a.weight, self.a.bias))
        if x.shape[0] > 4:
            return fake_fp8_linear(h, self.b.weight, self.b.bias)
        return torch.nn.functional.linear(h, self.b.weight, self.b.bias)


def branch_run(rank, world_size, batches, fail_at=None, use_pass=True):
    """Trains ``ShapeBranch`` under Thunder FSDP ZeRO-3 with this rank's ``batches``; returns what happened: the
    steps done, and the error (type, text, seconds into the run) where one was raised. ``fail_at``: a step at which
    rank 0 raises in its loss (after its forward)."""
    import thunder
    from thunder.distributed import FSDPType
    from thunder.distributed.transforms.fsdp_v2 import FSDPTransform

    from thunder_fp8shard import ShardIntermediates

    torch.manual_seed(0)
    transforms = [FSDPTransform(device=torch.device("cpu"), sharding_strategy=FSDPType.ZERO3)]
    jm = thunder.jit(ShapeBranch(), transforms=[*transforms, ShardIntermediates(min_bytes=0)] if use_pass else transforms)
    start, done = time.monotonic(), 0
    try:
        for step, n in enumerate(batches[rank]):
            gen = torch.Generator().manual_seed(100 * rank + step)
            loss = jm(torch.randn(n, 24, generator=gen)).square().mean()
            if step == fail_at and rank == 0:
                raise ValueError("planted: rank 0 fails in its loss")
            loss.backward()
            done += 1
    except Exception as e:  # noqa: BLE001  (what each rank got is the result)
        return done, type(e).__name__, str(e), time.monotonic() - start
    return done, None, None, time.monotonic() - start


def test_a_program_that_cannot_run_the_agreed_collectives_raises_instead_of_hanging():
    """Both ranks take the FP8 path at step 0 (the layout shards its copy); at step 1 rank 1's batch takes the other
    path: rank 1 raises while compiling, naming why, before its program runs a collective; rank 0, waiting in the
    step's collectives, gets an error as rank 1's process ends (gloo: at once), not a hang."""
    from thunder_fp8shard.testing.harness import run_on_ranks

    start = time.monotonic()
    (done0, kind0, _, _), (done1, kind1, text1, _) = run_on_ranks(branch_run, 2, ((6, 6, 6), (6, 3, 6)),
                                                                  timeout_s=BOUND_S)
    assert (done0, done1) == (1, 1) and kind1 == "RuntimeError", text1
    assert "this rank compiled a program (its own input shapes) whose collectives differ" in text1
    assert "cannot be sharded in this program" in text1 or "collective " in text1
    assert kind0 is not None  # rank 0 got an error instead of waiting for rank 1 forever
    assert time.monotonic() - start < BOUND_S


@pytest.mark.parametrize("use_pass", [False, True], ids=["without", "with"])
def test_a_rank_that_fails_mid_step_leaves_the_others_an_error_as_without_the_pass(use_pass):
    """Rank 0 raises in its loss at step 1 (between forward and backward) and its process ends: rank 1, in the step's
    backward collectives, gets an error, with and without the pass (gloo notices the closed connection)."""
    from thunder_fp8shard.testing.harness import run_on_ranks

    (done0, kind0, text0, _), (done1, kind1, _, seconds1) = run_on_ranks(
        branch_run, 2, ((6, 6, 6), (6, 6, 6)), 1, use_pass, timeout_s=BOUND_S)
    assert (done0, kind0) == (1, "ValueError") and "planted" in text0
    assert done1 == 1 and kind1 is not None and seconds1 < BOUND_S
