"""The pass in one process (world size 1, an in-process gloo group) under each setup: what it needs and refuses
with a clear message (no FSDP, a transform after it, a ``group=`` spanning other ranks, ThunderFX without FSDP2),
and what it plans and says when there is nothing to shard (one rank, forward-only, ZeRO-2's gathered weights, the
optimizer state left out of the peak)."""

import pytest
import torch

from thunder_fp8shard import ShardIntermediates
from thunder_fp8shard.planning.planner import ONE_RANK
from thunder_fp8shard.reporting.plan_text import plan_text
from thunder_fp8shard.testing.toy_models import FakeFP8MLP


def _jit(transforms):
    import thunder

    torch.manual_seed(0)
    return thunder.jit(FakeFP8MLP(), transforms=transforms)


def _fsdp(strategy="ZERO3"):
    from thunder.distributed import FSDPType
    from thunder.distributed.transforms.fsdp_v2 import FSDPTransform

    return FSDPTransform(device=torch.device("cpu"), sharding_strategy=FSDPType[strategy])


def test_without_fsdp_it_says_how_to_use_it():
    jm = _jit([ShardIntermediates()])
    usage = (r"ShardIntermediates needs Thunder FSDP or DDP, or FSDP2 under ThunderFX: use thunder.jit\(model, "
             r"transforms=\[FSDPTransform.*FSDP2 under ThunderFX: fully_shard\(block\) for each block")
    with pytest.raises(RuntimeError, match=usage):
        jm(torch.randn(3, 24, requires_grad=True))


@pytest.mark.parametrize("candidates", ["fp8", "all"])
def test_zero2_is_accepted_and_the_plan_says_what_stays_gathered(single_rank_group, candidates):
    shard = ShardIntermediates(candidates=candidates)
    jm = _jit([_fsdp("ZERO2"), shard])
    jm(torch.randn(3, 24, requires_grad=True)).sum().backward()
    plan = shard.plans[-1]
    assert plan.integration == "Thunder FSDP (ZeRO-2)" and plan_text(plan).startswith("ShardIntermediates plan: Thunder FSDP (ZeRO-2)")
    expected = "re-gathers the full-precision gathered weights too" if candidates == "all" else "weights stay gathered"
    assert expected in plan.notes[0] and expected in plan_text(plan)


def test_it_must_come_after_other_post_optimization_transforms(single_rank_group):
    from thunder.core.transform_common import Transform

    class Later(Transform):
        def transform_trace_post_optimization(self, trace, **kwargs):
            return trace

    jm = _jit([_fsdp(), ShardIntermediates(), Later()])
    with pytest.raises(RuntimeError, match="must be the last transform with a post-optimization step.*move it after Later"):
        jm(torch.randn(3, 24, requires_grad=True))


def test_world_size_one_shards_nothing_and_says_why(single_rank_group):
    shard = ShardIntermediates(min_bytes=0)
    jm, ref = _jit([_fsdp(), shard]), _jit([_fsdp()])
    x = torch.randn(3, 24, requires_grad=True)
    out, expected = jm(x), ref(x)
    out.sum().backward()
    assert torch.equal(out, expected)
    plan = shard.plans[-1]
    replicated = [d for d in plan.decisions if d.replicated]
    assert len(replicated) == 3 and not plan.sharded
    assert all(d.reason == ONE_RANK for d in replicated)
    assert plan.saved_bytes_after == plan.saved_bytes_before


@pytest.fixture(scope="module")
def peak_with_two_optimizer_states(single_rank_group):
    """The predicted peak before sharding with ``optimizer_states=2`` (compiled once for the three cases below)."""
    with_states = ShardIntermediates(optimizer_states=2)
    _jit([_fsdp(), with_states])(torch.randn(3, 24, requires_grad=True)).sum().backward()
    return with_states.plans[-1].peak_bytes_before


@pytest.mark.parametrize("states", [None, 0, 2])
def test_without_optimizer_states_the_headline_says_the_peak_leaves_out_the_optimizer_state(single_rank_group, states,
                                                                                            peak_with_two_optimizer_states):
    """A user who does not know ``optimizer_states`` reads, on the peak line itself, that the optimizer's state is
    not in it and what Adam/AdamW would add; given (0 or 2), the peak line has no such caveat."""
    shard = ShardIntermediates(optimizer_states=states)
    jm = _jit([_fsdp(), shard])
    x = torch.randn(3, 24, requires_grad=True)
    jm(x).sum().backward()
    plan = shard.plans[-1]
    # the gradients the backward returns: the parameters' (world size 1: whole shards) and x's
    grad_bytes = sum(p.numel() * p.element_size() for p in [*jm.parameters(), x])
    lines = plan_text(plan).splitlines()
    headline = next(i for i, line in enumerate(lines) if line.startswith("predicted peak per rank"))
    if states is None:
        assert [t.name for t in plan.left_out] == ["optimizer state"]
        assert lines[headline].endswith("WITHOUT 1 term(s) of unknown size:")
        assert "leaves out the optimizer state: unknown: pass optimizer_states (Adam, AdamW: 2" in lines[headline + 1]
        assert f"({2 * grad_bytes:,} B)" in lines[headline + 1]
    else:
        assert plan.left_out == [] and "WITHOUT" not in plan_text(plan)
    added = peak_with_two_optimizer_states - plan.peak_bytes_before
    assert added == {None: 2, 0: 2, 2: 0}[states] * grad_bytes  # the unknown term adds nothing to the peak


def test_inference_only_records_an_empty_plan_and_changes_nothing(single_rank_group):
    shard = ShardIntermediates()
    jm, ref = _jit([_fsdp(), shard]), _jit([_fsdp()])
    x = torch.randn(3, 24)
    with torch.no_grad():
        assert torch.equal(jm(x), ref(x))
    assert len(shard.plans) == 1 and shard.plans[0].decisions == ()
    assert "forward-only compile" in shard.plans[0].notes[0]
    assert "forward-only compile" in str(shard.plans[0])


def test_group_option_must_span_the_setups_ranks(single_rank_group, monkeypatch):
    import torch.distributed as dist

    from thunder_fp8shard.distributed import integrations
    from thunder_fp8shard.options import ShardOptions

    same_ranks = dist.new_group(ranks=[0])
    monkeypatch.setattr(integrations, "INTEGRATIONS", (lambda cd, o: integrations.Integration("Stub", single_rank_group),))
    assert integrations.detect(None, ShardOptions(group=same_ranks)).group is single_rank_group  # the setup's group
    real = dist.get_process_group_ranks
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda g: [0, 1] if g is single_rank_group else real(g))
    with pytest.raises(ValueError, match=r"group= spans ranks \[0\], but Stub works over ranks \[0, 1\]"):
        integrations.detect(None, ShardOptions(group=same_ranks))


def _thunderfx(model, transforms):
    import torch._dynamo
    from thunder.dynamo import ThunderCompiler

    torch._dynamo.reset()
    return torch.compile(model, backend=ThunderCompiler(transforms=transforms))


def test_thunderfx_without_fsdp2_parameters_asks_for_a_group(single_rank_group):
    torch.manual_seed(0)
    run = _thunderfx(FakeFP8MLP(), [ShardIntermediates()])
    with pytest.raises(Exception, match=r"no FSDP2 \(fully_shard\) parameter among its inputs .*pass ShardIntermediates\(group=\.\.\.\)"):
        run(torch.randn(3, 24, requires_grad=True))


def test_thunderfx_without_fsdp2_parameters_and_a_group_shards_nothing_and_says_why(single_rank_group):
    """Without FSDP2 nothing proves the parameters identical on every rank: every candidate is refused, with its
    reason, and the run is unchanged."""
    torch.manual_seed(0)
    shard = ShardIntermediates(group=single_rank_group, min_bytes=0)
    run, ref = _thunderfx(FakeFP8MLP(), [shard]), None
    x = torch.randn(3, 24, requires_grad=True)
    out = run(x)
    out.sum().backward()
    torch.manual_seed(0)
    ref = _thunderfx(FakeFP8MLP(), [])
    x_ref = x.detach().clone().requires_grad_()
    expected = ref(x_ref)
    expected.sum().backward()
    assert torch.equal(out, expected) and torch.equal(x.grad, x_ref.grad)
    (plan,) = shard.plans
    assert plan.integration == "FSDP2 (fully_shard) under ThunderFX, subgraph without FSDP2 parameters"
    assert "no FSDP2 parameter enters this subgraph" in plan.notes[0] and not plan.sharded
    weight_copies = [d for d in plan.decisions if d.shape in {(64, 24), (45, 64), (7, 45)}]
    assert len(weight_copies) == 3
    assert all(not d.replicated and "not an unsharded FSDP2 parameter" in d.reason for d in weight_copies)


def test_fsdp2_on_one_rank_proves_the_gathered_weight_copies_replicated(single_rank_group):
    """FSDP2 in this process (world size 1): each layer is its own subgraph whose weight input is FSDP2's unsharded
    parameter, so its FP8 copy is proven identical on every rank (and not sharded: there is one rank)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = FakeFP8MLP()
    mesh = init_device_mesh("cpu", (1,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    shard = ShardIntermediates(min_bytes=0)
    _thunderfx(model, [shard])(torch.randn(3, 24, requires_grad=True)).sum().backward()
    assert len(shard.plans) == 3
    for plan in shard.plans:
        assert plan.integration == "FSDP2 (fully_shard) under ThunderFX" and not plan.sharded
        (weight_copy,) = [d for d in plan.decisions if d.replicated]
        assert weight_copy.dtype == "float8_e4m3fn" and weight_copy.reason == ONE_RANK
        assert all("not an unsharded FSDP2 parameter" in d.reason for d in plan.decisions if not d.replicated)


def test_a_deep_copy_is_the_transform_itself(single_rank_group):
    """Lightning's ``torch.compile`` wrapper deep-copies the compile arguments (a ThunderCompiler and its transforms):
    a transform holding a process group must survive that, and keep its plans."""
    import copy

    shard = ShardIntermediates(group=single_rank_group, min_bytes=0)
    assert copy.deepcopy(shard) is shard
    assert copy.deepcopy({"backend": [shard]})["backend"][0] is shard
