"""A replication analysis that wrongly accepts per-rank tensors: ``verify=True`` must catch it, and without it the
gradients must visibly change (which shows the exactness checks can fail)."""

import pytest

from thunder_fp8shard.testing.reference_run import RunConfig, mismatches, train, train_with_and_without

pytestmark = pytest.mark.multirank


def _with_broken_analysis(job):
    def run(rank, world_size, cfg):
        from dataclasses import replace

        from thunder_fp8shard.analysis.replication import Replication

        def everything_replicated(trace, group, *roots_and_reasons):
            return Replication(frozenset(p.name for b in trace.bound_symbols for p in b.flat_proxy_outs))

        return job(rank, world_size, replace(cfg, seams={"replication_analysis": everything_replicated}))

    return run


def broken_train(rank, world_size, cfg):
    return _with_broken_analysis(train)(rank, world_size, cfg)


def broken_train_with_and_without(rank, world_size, cfg):
    return _with_broken_analysis(train_with_and_without)(rank, world_size, cfg)


def test_verify_names_the_divergent_tensor(on_ranks):
    cfg = RunConfig(options={"min_bytes": 0, "verify": True}, batch_sizes=(3,), no_grad_call=False)
    with pytest.raises(RuntimeError, match=r"saved tensor 't\d+' is not identical on every rank"):
        on_ranks(broken_train, 2, cfg)


def test_sharding_a_per_rank_activation_breaks_gradients(on_ranks):
    cfg = RunConfig(options={"min_bytes": 0}, batch_sizes=(3,), no_grad_call=False)
    results = on_ranks(broken_train_with_and_without, 2, cfg)
    assert any("weight" in m for base, shard in results for m in mismatches(base, shard))
