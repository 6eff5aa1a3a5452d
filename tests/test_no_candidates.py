"""A plan without candidates says what the forward saves (bytes by dtype) and what would make them candidates; the
README's straight-through FP8 layer (``FP8WeightLinear``) saves float8 weight copies that are candidates (issue
#33: a first FP8 layer written ``F.linear(x, w.to(float8).to(x.dtype))`` saves the upcast copy)."""

import torch
import torch.nn.functional as F
from torch import nn

from thunder_fp8shard import ShardIntermediates
from thunder_fp8shard.reporting.plan_text import plan_text
from thunder_fp8shard.testing.toy_models import FP8WeightLinear


class UpcastFP8(nn.Module):
    def __init__(self, straight_through: bool):
        super().__init__()
        self.l1, self.l2 = nn.Linear(32, 32, bias=False), nn.Linear(32, 32, bias=False)
        self.straight_through = straight_through

    def forward(self, x):
        for layer in (self.l1, self.l2):
            if self.straight_through:
                x = FP8WeightLinear.apply(x, layer.weight)
            else:  # the obvious way: Thunder saves the upcast float32 weight, not the float8 one
                x = F.linear(x, layer.weight.to(torch.float8_e4m3fn).to(x.dtype))
            x = torch.relu(x)
        return x


def _plan(straight_through: bool):
    import thunder
    from thunder.distributed import FSDPType
    from thunder.distributed.transforms.fsdp_v2 import FSDPTransform

    torch.manual_seed(0)
    shard = ShardIntermediates()
    fsdp = FSDPTransform(device=torch.device("cpu"), sharding_strategy=FSDPType.ZERO3)
    jm = thunder.jit(UpcastFP8(straight_through), transforms=[fsdp, shard])
    jm(torch.randn(4, 32, requires_grad=True)).sum().backward()
    return shard.plans[-1], [p.grad for p in jm.parameters()]


def test_no_candidates_are_explained_and_a_straight_through_fp8_layer_makes_them(single_rank_group):
    plan, _ = _plan(straight_through=False)
    assert plan.decisions == ()
    lines = plan_text(plan).splitlines()
    assert lines[2] == plan.no_candidates
    assert plan.no_candidates.startswith("no candidates: the forward saves ")
    assert " float32" in plan.no_candidates and "float8" not in plan.no_candidates.split("(each tensor")[0]
    assert 'candidates="all"' in plan.no_candidates and "torch.autograd.Function" in plan.no_candidates
    plan, grads = _plan(straight_through=True)
    assert [(d.dtype, d.shape, d.replicated) for d in plan.decisions] == [("float8_e4m3fn", (32, 32), True)] * 2
    assert plan.no_candidates == "" and all(g is not None and g.abs().sum() > 0 for g in grads)
