"""The GPU tests' training run (``thunder_fp8shard.testing.litgpt_run``) under each Thunder setup it builds, on the
CPU: the fake-FP8 toy Llama without TransformerEngine, two gloo ranks, different data per rank. Losses and every
gradient of three AdamW steps are bitwise equal with and without the pass and non-zero, and the pass shards."""

from __future__ import annotations

import pytest

from thunder_fp8shard.testing import litgpt_run

TOY = dict(model="toy", n_layer=2, n_embd=64, n_head=4, intermediate_size=96, vocab_size=128, seq_len=16,
           micro_batch_size=2, steps=3, te=False, device="cpu", return_grads=True, extra={"min_bytes": 0})


@pytest.mark.multirank
@pytest.mark.parametrize("setup", ["zero2", "ddp", "fsdp2"])
def test_litgpt_run_is_exact_under_each_setup_it_builds(setup, on_ranks):
    without, with_ = (on_ranks(litgpt_run.run_rank, 2, litgpt_run.RunConfig(**TOY, setup=setup, shard=s))
                      for s in (False, True))
    litgpt_run.assert_bitwise_equal_and_nonzero(without, with_, TOY["steps"])
    assert all(b["saved_bytes_measured"] < a["saved_bytes_measured"] for a, b in zip(without, with_))
    expected = {"zero2": "Thunder FSDP (ZeRO-2)", "ddp": "Thunder DDP", "fsdp2": "FSDP2"}[setup]
    assert expected in with_[0]["plan"]["text"].splitlines()[0]
    assert with_[0]["sharded_total"] > 0  # under FSDP2: summed over its subgraphs' plans


def test_litgpt_run_refuses_an_unknown_setup():
    with pytest.raises(ValueError, match="setup must be 'zero3', 'zero2', 'ddp' or 'fsdp2'"):
        litgpt_run.setup_rank(0, litgpt_run.RunConfig(**TOY, setup="hsdp"))
