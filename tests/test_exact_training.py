"""End-to-end exactness on real gloo processes: every rank draws different inputs, and the run with the pass must
match the same FSDP ZeRO-3 run without it bit for bit (losses, every gradient, a no-grad call), over three steps
with a new input shape between them."""

import pytest
import torch

from thunder_fp8shard.testing.reference_run import RunConfig, mismatches, train_with_and_without

pytestmark = pytest.mark.multirank

# every weight numel (61*25, 47*61, 7*47) is odd and not a multiple of 3: shards are padded for N = 2, 3 and 4
WIDTHS = (25, 61, 47, 7)
WEIGHT_SHAPES = {(61, 25), (47, 61), (7, 47)}


def _check_exact(results, expect_sharded_shapes=WEIGHT_SHAPES):
    """Bitwise equal to the run without the pass, non-zero gradients, and exactly the replicated weight copies
    sharded; with the default options, one bucket per tensor on FSDP's process group."""
    for rank, (base, shard) in enumerate(results):
        assert mismatches(base, shard) == [], f"rank {rank}"
        for step_grads in shard.grads:
            assert all(g.abs().sum() > 0 for g in step_grads.values()), "a compared gradient is zero: the check is void"
        plan = shard.plans[0]
        _check_copies_sharded_unless_raising(plan, expect_sharded_shapes)
        assert all(not d.sharded for d in plan.decisions if not d.replicated)
    # the ranks really saw different data
    assert not torch.equal(results[0][0].losses[0], results[1][0].losses[0])


def _check_copies_sharded_unless_raising(plan, shapes, dtype=None):
    """Every replicated copy of these shapes (and dtype) is sharded, but for those that would raise the predicted
    peak (policy "all" never does: under gloo a copy gathered back at the peak, with gloo's temporary of its size,
    can), and the peak does not rise."""
    from thunder_fp8shard.planning.planner import RAISES

    copies = [d for d in plan.decisions if d.replicated and d.shape in shapes and (dtype is None or d.dtype == dtype)]
    assert {d.shape for d in copies} == set(shapes)
    assert all(d.sharded or d.reason == RAISES for d in copies), [(d.name, d.reason) for d in copies]
    assert any(d.sharded for d in copies)
    assert plan.peak_bytes_after <= plan.peak_bytes_before


def _check_saved_bytes_drop_as_planned(results):
    for base, shard in results:
        # plans: [0] the first input shape, [1] the no-grad call, [2] the second shape; step 3 hits plans[0]'s entry
        plan_of_step = [shard.plans[0], shard.plans[2], shard.plans[0]]
        for step, plan in enumerate(plan_of_step):
            # the prediction counts each storage once, as saved_tensors_hooks sees them: equal to the byte
            assert (plan.saved_bytes_before, plan.saved_bytes_after) == (base.saved_bytes[step], shard.saved_bytes[step])
            assert plan.saved_bytes_after < plan.saved_bytes_before
        assert shard.plans[1].decisions == () and any("forward-only" in n for n in shard.plans[1].notes)


@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.setup_exactness("zero3")), 3, 4])
def test_exact_gradients_and_saved_bytes(world_size, on_ranks):
    results = on_ranks(train_with_and_without, world_size, RunConfig(widths=WIDTHS, options={"min_bytes": 0}))
    _check_exact(results)
    _check_saved_bytes_drop_as_planned(results)
    plan = results[0][1].plans[0]
    assert plan.comm == "shared" and [len(b.members) for b in plan.buckets] == [1, 1, 1]  # the defaults


# with 256-320 rows a batch the activations dwarf the weights and the peak is the forward's: keeping the first two
# weight copies (in backward order) in one shard op costs no predicted peak, while gathering them together would
LARGE_BATCHES = (256, 320, 256)


def test_reduce_scatter_method_into_a_shared_shard_op_is_exact(on_ranks):
    options = {"min_bytes": 0, "method": "reduce_scatter", "prefetch": 0}
    results = on_ranks(train_with_and_without, 3, RunConfig(widths=WIDTHS, batch_sizes=LARGE_BATCHES, options=options))
    _check_exact(results)
    _check_saved_bytes_drop_as_planned(results)
    plan = results[0][1].plans[0]
    assert [(b.nbytes, b.shard_op) for b in plan.buckets] == [(1525, 0), (2867, 0), (329, 0)]  # one op, 3 buckets
    assert plan.comm == "shared"


def test_thunder_distributed_fsdp_api_verify_and_a_size_cap(on_ranks):
    # in order of first backward use (the recomputed dequantizations come first) the weight copies hold 1,525,
    # 2,867 and 329 bytes: a 3,200-byte cap keeps the first two in buckets of their own (one shard op keeps both:
    # the cap bounds the all-gathers, not the shard ops). Gathered with prefetch=2,
    # each copy would be back (with gloo's temporary of its size) at the backward's peak and raise it: policy "all"
    # would shard none
    options = {"min_bytes": 0, "verify": True, "prefetch": 0, "bucket_bytes": 3200, "comm": "dedicated"}
    cfg = RunConfig(widths=WIDTHS, batch_sizes=LARGE_BATCHES, api="fsdp", options=options)
    results = on_ranks(train_with_and_without, 2, cfg)
    _check_exact(results)
    _check_saved_bytes_drop_as_planned(results)
    plan = results[0][1].plans[0]
    assert [(b.nbytes, b.shard_op) for b in plan.buckets][:2] == [(1525, 0), (2867, 0)] and plan.comm == "dedicated"


def test_all_candidates_shards_the_gathered_full_precision_weights_too(on_ranks):
    cfg = RunConfig(widths=WIDTHS, options={"min_bytes": 64, "candidates": "all"})
    results = on_ranks(train_with_and_without, 2, cfg)
    plan = results[0][1].plans[0]
    _check_copies_sharded_unless_raising(plan, WEIGHT_SHAPES, "float8_e4m3fn")
    # Thunder saves the all-gathered weights under ZeRO-3: sharded too, where they do not raise the predicted peak
    fp32 = [d for d in plan.decisions if d.replicated and d.shape in WEIGHT_SHAPES and d.dtype == "float32"]
    assert {d.shape for d in fp32} == WEIGHT_SHAPES and all(d.sharded or "raise" in d.reason for d in fp32)
    assert all(d.nbytes >= 64 for d in plan.sharded)
    for rank, (base, shard) in enumerate(results):
        assert mismatches(base, shard) == [], f"rank {rank}"
    _check_saved_bytes_drop_as_planned(results)


# at k=2 the gathered weights of 64 and 8 rows are exactly two parameter shards each (their shard is the parameter's
# own, nothing is copied); 47 rows are padded, so that weight is copied into a shard as before
OWN_WIDTHS = (24, 64, 47, 8)


def test_gathered_weights_whose_shard_is_the_parameter_are_exact_and_keep_no_copy(on_ranks):
    cfg = RunConfig(widths=OWN_WIDTHS, options={"min_bytes": 64, "candidates": "all"})
    results = on_ranks(train_with_and_without, 2, cfg)
    for rank, (base, shard) in enumerate(results):
        assert mismatches(base, shard) == [], f"rank {rank}"
        for step_grads in shard.grads:
            assert all(g.abs().sum() > 0 for g in step_grads.values()), "a compared gradient is zero: the check is void"
    assert not torch.equal(results[0][0].losses[0], results[1][0].losses[0])  # the ranks saw different data
    _check_saved_bytes_drop_as_planned(results)  # the saved parameter shard counted as saved_tensors_hooks sees it
    plan = results[0][1].plans[0]
    # the all-gathered weights of even rows (the model's other fp32 tensors of their shapes are computed from them)
    own = {d.name: d for d in plan.decisions if d.shard_source}
    assert {d.shape for d in own.values()} == {(64, 24), (8, 47)}, [(d.name, d.shape) for d in own.values()]
    assert len({d.shard_source for d in own.values()}) == len(own)
    assert all(d.sharded and d.dtype == "float32" and d.bytes_saved == d.nbytes for d in own.values())
    by_member = {m: b for b in plan.buckets for m in b.members}
    for name, d in own.items():  # buckets of inputs (one coalesced all-gather each), with no shard op call
        b = by_member[name]
        assert b.sources and b.sources[b.members.index(name)] == d.shard_source
        assert sum(1 for o in plan.buckets if o.shard_op == b.shard_op) == 1
    made = {b.shard_op for b in plan.buckets if not b.sources}
    assert plan.operator_calls["fp8shard_shard"] == len(made)
    from thunder_fp8shard.reporting.plan_text import plan_text

    assert "parameter shard(s) the forward all-gathered (no copy)" in plan_text(plan)


def test_peak_policy_is_exact_and_never_raises_the_predicted_peak(on_ranks):
    cfg = RunConfig(widths=WIDTHS, batch_sizes=(3,), no_grad_call=False, options={"min_bytes": 0, "policy": "peak"})
    results = on_ranks(train_with_and_without, 2, cfg)
    for rank, (base, shard) in enumerate(results):
        assert mismatches(base, shard) == [], f"rank {rank}"
        plan = shard.plans[0]
        assert plan.peak_bytes_after <= plan.peak_bytes_before
        assert plan.timeline_after.peak_bytes == plan.peak_bytes_after
        for d in plan.decisions:
            assert d.sharded or d.reason.startswith(("per-rank", "does not lower the predicted peak", "idle interval"))


@pytest.mark.parametrize("setup, world_size", [
    pytest.param("zero2", 2, marks=pytest.mark.setup_exactness("zero2")),
    pytest.param("ddp", 2, marks=pytest.mark.setup_exactness("ddp")),
    ("zero2", 3), ("ddp", 3),
])
def test_zero2_and_ddp_are_exact_and_save_as_planned(setup, world_size, on_ranks):
    """Thunder FSDP ZeRO-2 and Thunder DDP: the weight copies are identical on every rank there too (gathered
    weights; DDP's replicated parameters), so the same three are sharded, exactly."""
    cfg = RunConfig(widths=WIDTHS, options={"min_bytes": 0}, **(
        {"sharding_strategy": "ZERO2"} if setup == "zero2" else {"api": "ddp"}))
    results = on_ranks(train_with_and_without, world_size, cfg)
    _check_exact(results)
    _check_saved_bytes_drop_as_planned(results)
    plan = results[0][1].plans[0]
    assert plan.integration == {"zero2": "Thunder FSDP (ZeRO-2)", "ddp": "Thunder DDP"}[setup]


def _kept_outside_the_subgraphs(world_size, batch):
    """Bytes autograd keeps for backward under FSDP2 that no subgraph's plan counts: the GELU between the layers runs
    eagerly and saves its input, and each saved unsharded weight lives in FSDP2's all-gather output, padded on dim 0
    to a multiple of the world size (float32)."""
    gelu_inputs = sum(batch * w for w in WIDTHS[1:-1]) * 4
    padding = sum((-o % world_size) * i for i, o in zip(WIDTHS[:-1], WIDTHS[1:])) * 4
    return gelu_inputs + padding


@pytest.mark.parametrize(
    "world_size, scope, strategy, no_grad_call, options",
    [pytest.param(2, "model", "ZERO3", True, {}, marks=pytest.mark.setup_exactness("fsdp2")), (3, "layers", "ZERO2", False, {"verify": True, "comm": "dedicated", "prefetch": 0})],
)
def test_fsdp2_under_thunderfx_is_exact_and_saves_as_planned(world_size, scope, strategy, no_grad_call, options,
                                                             on_ranks):
    """PyTorch FSDP2 (fully_shard on every layer and the model) compiled by ThunderFX, the whole model (Thunder's
    benchmark_litgpt) or each layer (torchtitan): one subgraph per layer, each planned on its own; the FP8 copy of its
    all-gathered weight is sharded, everything derived from the rank's input is refused as per-rank. Bitwise equal to
    the same run without the pass, gradients after FSDP2's reduce-scatter included."""
    cfg = RunConfig(widths=WIDTHS, api="fsdp2", compile_scope=scope, sharding_strategy=strategy,
                    no_grad_call=no_grad_call, options={"min_bytes": 0, **options})
    results = on_ranks(train_with_and_without, world_size, cfg)
    for rank, (base, shard) in enumerate(results):
        assert mismatches(base, shard) == [], f"rank {rank}"
        for step_grads in shard.grads:
            assert all(g.abs().sum() > 0 for g in step_grads.values()), "a compared gradient is zero: the check is void"
        for step, plan_indices in enumerate(shard.step_plans):
            plans = [shard.plans[i] for i in plan_indices]
            assert len(plans) == 3, "one Thunder compilation per layer (the 3rd step: a new cache entry, same shape)"
            for plan in plans:
                assert plan.integration == "FSDP2 (fully_shard) under ThunderFX" and plan.comm == options.get("comm", "shared")
                assert len(plan.sharded) == 1 and plan.sharded[0].dtype == "float8_e4m3fn"
                refused = [d for d in plan.decisions if not d.sharded]
                assert refused and all(not d.replicated and "not an unsharded FSDP2 parameter" in d.reason for d in refused)
            assert {p.sharded[0].shape for p in plans} == WEIGHT_SHAPES
            # measured: the saved bytes drop exactly as planned, and the rest is what is kept outside the subgraphs
            before, after = (sum(getattr(p, f"saved_bytes_{k}") for p in plans) for k in ("before", "after"))
            outside = _kept_outside_the_subgraphs(world_size, cfg.batch_sizes[step])
            assert (base.saved_bytes[step], shard.saved_bytes[step]) == (before + outside, after + outside)
            assert after < before
        no_grad = [p for i, p in enumerate(shard.plans) if all(i not in s for s in shard.step_plans)]
        assert len(no_grad) == (3 if no_grad_call else 0) and all(p.decisions == () and any("forward-only" in n for n in p.notes) for p in no_grad)
    assert not torch.equal(results[0][0].losses[0], results[1][0].losses[0])


def test_gradient_accumulation_with_the_reduction_skipped_is_exact_under_ddp_and_zero3(on_ranks):
    """Thunder DDP under ``skip_data_parallel_grad_sync()`` compiles a program with the same forward and no all-reduce
    in its backward, then the synced micro-batch another: the pass keys a program by its backward's collectives too.
    The first program compiled (every rank together) is sharded; the synced one, compiled later, keeps Thunder's own
    collectives (nothing sharded, no collective to agree it), and says why. It raised before. Under ZeRO-3 the
    reduction's skip leaves the kinds of collective as they were: the synced program realizes the agreed layout. Two
    steps of three micro-batches, every rank its own inputs: losses and gradients bitwise those without the pass, and
    non-zero."""
    from thunder_fp8shard.testing.generated import Case, with_and_without_accumulation

    for setup in ("DDP", "ZERO3"):
        case = Case(0, setup, ("linear", "fp8", "shared", "fp8"), candidates=("auto",), d=64, batch=(2, 8))
        runs = on_ranks(with_and_without_accumulation, 2, case)
        assert not torch.equal(runs[0][None][2][0], runs[1][None][2][0]), "the ranks must see different inputs"
        for rank, run in enumerate(runs):
            (base, _, base_losses), (grads, plans, losses) = run[None], run["auto"]
            assert all(torch.equal(a, b) for a, b in zip(losses, base_losses, strict=True)), (setup, rank)
            assert grads.keys() == base.keys() and all(torch.equal(grads[n], base[n]) for n in base), (setup, rank)
            assert all(g.count_nonzero() > 0 for g in grads.values()), "a compared gradient is zero: the check is void"
            assert len(plans) == 2 and plans[0].sharded, (setup, rank, plans)
            later = "did not compile together" if setup == "DDP" else "the model's agreed layout"
            assert bool(plans[1].sharded) == (setup == "ZERO3") and any(later in n for n in plans[1].notes), plans[1]
