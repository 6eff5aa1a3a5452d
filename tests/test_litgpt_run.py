"""The GPU tests' training run (``thunder_fp8shard.testing.litgpt_run``) under each Thunder setup it builds, on the
CPU: the fake-FP8 toy Llama (LitGPT's attention with RoPE) under Thunder's benchmark executors (the cat executor's
CPU twin first) without TransformerEngine, two gloo ranks, different data per rank. Losses and every gradient of
three AdamW steps are bitwise equal with and without the pass and non-zero; what the GPU tests assume is asserted
here too: every block's five weight copies sharded (and the toy's lm_head's), every block's ``v`` compacted, the
saved bytes falling by exactly the plans' prediction, each plan counted once per run (under FSDP2 one subgraph
serves both blocks: its plan runs twice a step)."""

from __future__ import annotations

import importlib.util

import pytest

from thunder_fp8shard.testing import litgpt_run

N_LAYER = 2
TOY = dict(model="toy", n_layer=N_LAYER, n_embd=64, n_head=4, intermediate_size=96, vocab_size=128, seq_len=16,
           micro_batch_size=2, steps=3, te=False, device="cpu", return_grads=True, extra={"min_bytes": 0})


@pytest.mark.multirank
@pytest.mark.parametrize("setup", ["zero3", "zero2", "ddp", "fsdp2"])
def test_litgpt_run_is_exact_under_each_setup_it_builds(setup, on_ranks):
    without, with_ = (on_ranks(litgpt_run.run_rank, 2, litgpt_run.RunConfig(**TOY, setup=setup, shard=s))
                      for s in (False, True))
    litgpt_run.assert_bitwise_equal_and_nonzero(without, with_, TOY["steps"])
    expected = {"zero3": "Thunder FSDP (ZeRO-3)", "zero2": "Thunder FSDP (ZeRO-2)", "ddp": "Thunder DDP",
                "fsdp2": "FSDP2"}[setup]
    run = with_[0]
    assert expected in run["plan"]["text"].splitlines()[0]
    # each block's qkv, proj, fc_1, fc_2 and mlp_proj weight copies and the lm_head's (the toy recomputes its
    # dequantization later in the backward: its all-gather has compute to hide behind), each block's v
    # but those policy "all" leaves out because they would raise the predicted peak (on the CPU a copy gathered back
    # before the peak is held there with its shard and gloo's temporary of its size)
    why = (run["runs_per_step"], run["plan"]["operator_calls"], run["plan"]["text"])
    assert run["sharded_total"] + run["raising_total"] == 5 * N_LAYER + 1, why
    assert run["sharded_total"] >= 5 * N_LAYER and run["compacted_total"] == N_LAYER, why
    if setup == "fsdp2":  # one Dynamo graph, one Thunder compilation, for both blocks: its plan runs twice a step
        assert sorted(run["runs_per_step"]) == [1, 2], run["runs_per_step"]
    else:
        assert run["runs_per_step"] == [1]
        # both blocks' v compacted in one call (no shard op follows them in this toy's forward: every weight copy's
        # last forward use comes first), the checks gone after the calibration step
        calls = run["plan"]["operator_calls"]
        assert "fp8shard_audit" not in calls, calls
        if setup == "ddp":  # under DDP a shard op follows each v: both compactions made by shard ops' calls
            assert calls["fp8shard_compact"] == 0 and run["plan"]["compactions_in_shard_ops"] == N_LAYER, calls
        else:
            # 7 buckets with all 11 copies sharded, one fewer a copy left out; their shard ops merged where the
            # predicted peak does not rise (one a bucket while bucket_bytes bounded them)
            buckets = calls["fp8shard_gather_start"] + calls["fp8shard_gather_next"]
            assert calls["fp8shard_compact"] == 1 and buckets == 7 - run["raising_total"], calls
            assert 1 <= calls["fp8shard_shard"] < buckets, calls
    assert run["plan"]["checks_removed"].startswith("after backward call"), run["plan"]["checks_removed"]
    for a, b in zip(without, with_):  # the plans' predicted saving, each counted once per run, is what autograd saves
        assert a["saved_bytes_measured"] - b["saved_bytes_measured"] == b["predicted_saving_total"] > 0


def test_litgpt_run_refuses_an_unknown_setup():
    with pytest.raises(ValueError, match="setup must be 'zero3', 'zero2', 'ddp' or 'fsdp2'"):
        litgpt_run.setup_rank(0, litgpt_run.RunConfig(**TOY, setup="hsdp"))


# litgpt's own Llama (its Block: what Thunder's benchmark wraps under --checkpoint_activations=True), shrunk, bf16
CHECKPOINTED = dict(model="litgpt", model_name="Llama-2-7b-hf", n_layer=N_LAYER, n_embd=64, n_head=4,
                    intermediate_size=96, vocab_size=128, seq_len=16, micro_batch_size=2, steps=3, te=False,
                    device="cpu", return_grads=True, checkpoint_activations=True)


@pytest.mark.multirank
def test_checkpointed_blocks_gathered_weights_sharded_exactly(on_ranks):
    """Every litgpt block under ``torch.utils.checkpoint`` (as Thunder's benchmark's ``--checkpoint_activations=True``
    wraps them), Thunder FSDP ZeRO-3, two gloo ranks, ``candidates="all"``: Thunder saves each block's all-gathered
    weights for the recompute in backward; they are replicated candidates, sharded (but those the plan leaves out), the
    saved bytes fall by the plan's prediction, and losses and every gradient of three AdamW steps are bitwise equal
    to the run without the pass."""
    # the device image's (and a dev install's), not the test extra's; looked up, not imported: importing litgpt here
    # imports lightning, whose fabric wraps torch.compile in this process, for the tests that run here after this one
    if importlib.util.find_spec("litgpt") is None:
        pytest.skip("litgpt is not installed")
    extra = {"candidates": "all", "min_bytes": 0}
    without, with_ = (on_ranks(litgpt_run.run_rank, 2, litgpt_run.RunConfig(**CHECKPOINTED, shard=s, extra=extra))
                      for s in (False, True))
    litgpt_run.assert_bitwise_equal_and_nonzero(without, with_, CHECKPOINTED["steps"])
    plan = with_[0]["plan"]
    e, i = CHECKPOINTED["n_embd"], CHECKPOINTED["intermediate_size"]
    block_weights = sorted([[3 * e, e], [e, e], [i, e], [i, e], [e, i]] * N_LAYER)
    weights = [d for d in plan["decisions"] if d["replicated"] and len(d["shape"]) == 2 and d["shape"] != [128, e]]
    assert sorted(d["shape"] for d in weights) == block_weights, plan["text"]
    assert sum(d["sharded"] for d in weights) >= 5, plan["text"]  # at least one block's weights
    for a, b in zip(without, with_):
        assert a["saved_bytes_measured"] - b["saved_bytes_measured"] == b["predicted_saving_total"] > 0
