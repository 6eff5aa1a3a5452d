"""Sharding over subgroups (``shard_group_size=k``) and FSDP2 HSDP: the shards are 1/k over runs of k consecutive
ranks, bitwise exact on real gloo ranks, and sizes that do not divide the world are refused."""

import pytest
import torch

from thunder_fp8shard import ShardIntermediates
from thunder_fp8shard.planning.layout import bucket_layout
from thunder_fp8shard.distributed.shard_groups import partition
from thunder_fp8shard.reporting.plan_text import plan_text
from thunder_fp8shard.testing.harness import run_simulated
from thunder_fp8shard.testing.reference_run import RunConfig, mismatches, train_with_and_without

# every weight numel (61*25, 47*61, 7*47) is odd: the shards are padded for every k > 1
WIDTHS = (25, 61, 47, 7)
WEIGHT_SHAPES = {(61, 25), (47, 61), (7, 47)}


@pytest.mark.parametrize("k", [0, -2, 2.0, True, "2"])
def test_subgroup_size_must_be_a_positive_int(k):
    with pytest.raises(ValueError, match=r"shard_group_size must be a positive int"):
        ShardIntermediates(shard_group_size=k)


def test_subgroup_partition_is_runs_of_consecutive_ranks_and_refuses_non_divisors():
    assert partition((0, 1, 2, 3, 4, 5, 6, 7), 4) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert partition((3, 1, 2, 0), 2) == [(3, 1), (2, 0)]  # in the group's order
    with pytest.raises(ValueError, match=r"shard_group_size=3 does not divide the 8 ranks of X.*one of \[1, 2, 4, 8\]"):
        partition(tuple(range(8)), 3, "X")


def _plans_under_fake_pg(rank, world_size, configs):
    """Thunder FSDP ZeRO-3 of the fake-FP8 MLP as rank 0 of ``world_size`` under torch's fake process group, once per
    ``(subgroup size, FSDP's ranks or None for all)``: each plan (or the error) and the saved bytes measured in that
    forward."""
    import torch.distributed as dist
    import thunder
    from thunder.distributed import FSDPType
    from thunder.distributed.transforms.fsdp_v2 import FSDPTransform

    from thunder_fp8shard.testing.measure import saved_bytes
    from thunder_fp8shard.testing.toy_models import FakeFP8MLP

    out = {}
    for k, fsdp_ranks in configs:
        group = dist.new_group(ranks=list(fsdp_ranks)) if fsdp_ranks else None
        try:
            shard = ShardIntermediates(min_bytes=0, shard_group_size=k)
            fsdp = FSDPTransform(device=torch.device("cpu"), sharding_strategy=FSDPType.ZERO3, process_group=group)
            jm = thunder.jit(FakeFP8MLP(WIDTHS), transforms=[fsdp, shard])
            with saved_bytes() as saved:
                y = jm(torch.randn(3, WIDTHS[0], requires_grad=True))
            y.sum().backward()
            out[k, fsdp_ranks] = (shard.plans[-1], saved.total)
        except ValueError as e:
            out[k, fsdp_ranks] = str(e)
    return out


@pytest.mark.simulated
def test_subgroup_shards_are_1_over_k_under_the_fake_process_group():
    """Rank 0 of 8 simulated (how the benchmarks measure memory on one GPU): k = 2, 4, 8 keep 1/k of every weight
    copy, over ranks 0..k-1, and the plan's saved bytes are those measured; k = 3 and 16 are refused when
    constructing (they cannot divide the world's 8 ranks), k = 4 when compiling FSDP over 6 of the 8 ranks."""
    six = tuple(range(6))
    got = run_simulated(_plans_under_fake_pg, 8, [(2, None), (4, None), (8, None), (3, None), (16, None), (4, six),
                                                  (2, six)])
    for k in (3, 16):
        assert f"shard_group_size={k} does not divide the 8 ranks of the world" in got[k, None]
    assert "shard_group_size=4 does not divide the 6 ranks of Thunder FSDP (ZeRO-3)" in got[4, six]
    assert got[2, six][0].shard_ranks == (0, 1) and got[2, six][0].world_size == 6
    for k in (2, 4, 8):
        plan, measured = got[k, None]
        assert (plan.world_size, plan.shard_group_size, plan.shard_ranks) == (8, k, tuple(range(k)))
        assert plan.shard_group_origin == ("own" if k == 8 else "partition")
        assert {d.shape for d in plan.sharded} == WEIGHT_SHAPES and len(plan.buckets) == 3
        for d in plan.sharded:
            assert d.shard_nbytes == -(-d.nbytes // k) and f"1/{k}" in d.reason
        for b in plan.buckets:
            assert b.shard_nbytes == bucket_layout([b.nbytes], k).shard_nbytes and b.gathered_nbytes == k * b.shard_nbytes
        copies = sum(d.nbytes for d in plan.sharded)
        assert plan.saved_bytes_before - plan.saved_bytes_after == copies - sum(b.shard_nbytes for b in plan.buckets)
        assert plan.gathered_bytes_per_step == (k - 1) * sum(b.shard_nbytes for b in plan.buckets)
        assert measured == plan.saved_bytes_after
        text = plan_text(plan)
        assert f"each copy keeps 1/{k}, saving {k - 1}/{k}" in text and f"{plan.gathered_bytes_per_step:,} B" in text
    savings = {k: got[k, None][0].saved_bytes_before - got[k, None][0].saved_bytes_after for k in (2, 4, 8)}
    assert savings[2] < savings[4] < savings[8]


def _check_exact_and_as_planned(results, plan_of_step):
    for rank, (base, shard) in enumerate(results):
        assert mismatches(base, shard) == [], f"rank {rank}"
        for step_grads in shard.grads:
            assert all(g.abs().sum() > 0 for g in step_grads.values()), "a compared gradient is zero: the check is void"
        for step, plans in enumerate(plan_of_step(shard)):
            before, after = sum(p.saved_bytes_before for p in plans), sum(p.saved_bytes_after for p in plans)
            yield rank, step, plans, (base.saved_bytes[step] - before, shard.saved_bytes[step] - after), after < before
    assert not torch.equal(results[0][0].losses[0], results[1][0].losses[0])


@pytest.mark.multirank
def test_subgroup_of_2_under_thunder_fsdp_zero3_over_4_ranks_is_exact(on_ranks):
    """4 gloo ranks, subgroups {0, 1} and {2, 3}: every weight copy kept as a 1/2 shard, gathered within its pair;
    losses and gradients bitwise those of the run without the pass; saved bytes as planned."""
    cfg = RunConfig(widths=WIDTHS, batch_sizes=(3, 3), no_grad_call=False,
                    options={"min_bytes": 0, "shard_group_size": 2})
    results = on_ranks(train_with_and_without, 4, cfg)
    for rank, step, (plan,), unplanned, saves in _check_exact_and_as_planned(results, lambda r: [r.plans[:1]] * 2):
        assert unplanned == (0, 0) and saves  # measured == planned, with and without the pass
        assert (plan.world_size, plan.shard_group_size, plan.shard_group_origin) == (4, 2, "partition")
        assert plan.shard_ranks == ((0, 1) if rank < 2 else (2, 3))
        assert {d.shape for d in plan.sharded} == WEIGHT_SHAPES
        assert all(d.shard_nbytes == -(-d.nbytes // 2) for d in plan.sharded)


def _kept_outside_the_subgraphs(shard_size, batch):
    """Bytes autograd keeps under FSDP2 that no subgraph's plan counts: the GELU inputs between the layers, and the
    padding of each saved unsharded weight (dim 0 padded to a multiple of the shard dimension, float32)."""
    gelu_inputs = sum(batch * w for w in WIDTHS[1:-1]) * 4
    padding = sum((-o % shard_size) * i for i, o in zip(WIDTHS[:-1], WIDTHS[1:])) * 4
    return gelu_inputs + padding


@pytest.mark.multirank
def test_fsdp2_hsdp_2x2_shards_over_the_mesh_shard_dimension_and_is_exact(on_ranks):
    """FSDP2 HSDP on a 2 x 2 mesh (replicate x shard) under ThunderFX: the shards default to the mesh's shard
    dimension (ranks {0, 1} and {2, 3}); bitwise exact, FSDP2's reduce-scatter and all-reduce included."""
    cfg = RunConfig(widths=WIDTHS, api="fsdp2", mesh_shape=(2, 2), batch_sizes=(3, 3), no_grad_call=False,
                    options={"min_bytes": 0})
    results = on_ranks(train_with_and_without, 4, cfg)
    # the second step hits the cache entries of the first: no new plan, the first step's hold
    step_plans = lambda r: [[r.plans[i] for i in r.step_plans[0]]] * 2  # noqa: E731
    assert all(r[1].step_plans[1] == [] for r in results)
    for rank, step, plans, unplanned, saves in _check_exact_and_as_planned(results, step_plans):
        outside = _kept_outside_the_subgraphs(2, cfg.batch_sizes[step])
        assert unplanned == (outside, outside) and saves
        assert len(plans) == 3 and {p.sharded[0].shape for p in plans} == WEIGHT_SHAPES
        for plan in plans:
            assert plan.integration == "FSDP2 HSDP (fully_shard over a 2-D mesh) under ThunderFX"
            assert (plan.world_size, plan.shard_group_size, plan.shard_group_origin) == (4, 2, "own")
            assert plan.shard_ranks == ((0, 1) if rank < 2 else (2, 3))
            assert len(plan.sharded) == 1 and plan.sharded[0].shard_nbytes == -(-plan.sharded[0].nbytes // 2)
            assert "2 x 2 mesh" in plan.notes[0] and "the default" in plan.notes[0]
