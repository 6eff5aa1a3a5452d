"""The replication analysis (thunder_fp8shard.analysis.replication) on real Thunder FSDP ZeRO-3 traces: which saved tensors are
identical on every rank, and why the others are not."""

import torch
from thunder.core import dtypes
from thunder.core.proxies import TensorProxy
from thunder.core.utils import producers

from thunder_fp8shard.analysis.replication import analyze_replication
from thunder_fp8shard.analysis.saved import forward_saved

WEIGHT_SHAPES = {(64, 24), (45, 64), (7, 45)}  # FakeFP8MLP((24, 64, 45, 7))
ACTIVATION_SHAPES = {(3, 24), (3, 64), (3, 45)}  # its inputs per layer, batch 3


def _ancestors(trace, proxy):
    """Names of every proxy ``proxy`` is computed from (through the trace's producers)."""
    prod = producers(trace)
    seen, todo = set(), [proxy]
    while todo:
        p = todo.pop()
        if p.name in seen:
            continue
        seen.add(p.name)
        if p in prod:
            todo += [a for a in prod[p].flat_proxy_args if isinstance(a, TensorProxy)]
    return seen


def _from_input(fw, p):
    return fw.args[0].name in _ancestors(fw, p)  # args[0] is the model input x


def test_fp8_weight_copies_and_their_scales_are_replicated(fsdp_traces):
    fw, _, group = fsdp_traces
    rep = analyze_replication(fw, group)
    saved = forward_saved(fw)[0]
    weight_copies = [p for p in saved if p.dtype == dtypes.float8_e4m3fn and tuple(p.shape) in WEIGHT_SHAPES]
    assert len(weight_copies) == 3 and all(rep.is_replicated(p.name) for p in weight_copies)
    weight_scales = [p for p in saved if p.ndim == 0 and not _from_input(fw, p)]
    assert len(weight_scales) == 3 and all(rep.is_replicated(p.name) for p in weight_scales)


def test_per_rank_activations_input_scales_and_everything_downstream_are_refused(fsdp_traces):
    fw, _, group = fsdp_traces
    rep = analyze_replication(fw, group)
    saved = forward_saved(fw)[0]
    act_copies = [p for p in saved if p.dtype == dtypes.float8_e4m3fn and tuple(p.shape) in ACTIVATION_SHAPES]
    input_scales = [p for p in saved if p.ndim == 0 and _from_input(fw, p)]
    assert len(act_copies) == 3 and len(input_scales) == 3
    for p in act_copies + input_scales:
        assert not rep.is_replicated(p.name)
        assert "the rank's input `x`" in rep.reason(p.name)
    # downstream: every tensor computed from the input, e.g. the layer outputs, is per-rank too
    downstream = [p for b in fw.bound_symbols for p in b.flat_proxy_outs if isinstance(p, TensorProxy) and _from_input(fw, p)]
    assert len(downstream) > 20 and not any(rep.is_replicated(p.name) for p in downstream)


def test_parameter_shards_are_per_rank_and_gathers_over_another_group_are_refused(fsdp_traces):
    fw, _, group = fsdp_traces
    shards = [a for a in fw.args[1:] if isinstance(a, TensorProxy)]
    rep = analyze_replication(fw, group)
    assert all("parameter shard" in rep.reason(a.name) for a in shards)
    other = analyze_replication(fw, object())  # not the group the gathers use
    assert other.replicated == frozenset()
    weight_copies = [p for p in forward_saved(fw)[0] if tuple(p.shape) in WEIGHT_SHAPES and p.dtype == dtypes.float8_e4m3fn]
    assert all("another process group" in other.reason(p.name) for p in weight_copies)


class NoisyWeight(torch.nn.Linear):
    def forward(self, x):
        with torch.no_grad():
            wq = (self.weight + torch.rand_like(self.weight)).to(torch.float8_e4m3fn)  # random: per-rank
        return torch.nn.functional.linear(x, self.weight) + wq.to(torch.float32).sum()


def _fsdp_forward_trace(model, x):
    import thunder
    from thunder.distributed import FSDPType
    from thunder.distributed.transforms.fsdp_v2 import FSDPTransform

    jm = thunder.jit(model, transforms=[FSDPTransform(device=torch.device("cpu"), sharding_strategy=FSDPType.ZERO3)])
    jm(x)
    return thunder.last_traces(jm)[-1], thunder.compile_data(jm).process_group_for_ddp


def test_random_values_are_per_rank(single_rank_group):
    fw, group = _fsdp_forward_trace(NoisyWeight(8, 4), torch.randn(2, 8, requires_grad=True))
    rep = analyze_replication(fw, group)
    fp8 = [p for b in fw.bound_symbols for p in b.flat_proxy_outs if isinstance(p, TensorProxy) and p.dtype == dtypes.float8_e4m3fn]
    assert fp8 and all("random numbers" in rep.reason(p.name) for p in fp8)


def test_an_operation_the_analysis_does_not_understand_is_per_rank(fsdp_traces):
    from thunder.core.trace import from_trace, tracectx
    from thunder.extend import OperatorExecutor

    fw, _, group = fsdp_traces
    ex = OperatorExecutor("test_opaque_ex")
    opaque = ex.register_operator("test_opaque_op", meta=lambda t: TensorProxy(like=t), fn=lambda t: t.clone())
    weight_copy = next(p for p in forward_saved(fw)[0] if tuple(p.shape) == (64, 24) and p.dtype == dtypes.float8_e4m3fn)
    trace = from_trace(fw)
    with tracectx(trace):
        trace.push_scope([])
        out = opaque(weight_copy)
        new = trace.pop_scope()
    trace.bound_symbols = [*fw.bound_symbols[:-1], *new, fw.bound_symbols[-1]]
    rep = analyze_replication(trace, group)
    assert rep.is_replicated(weight_copy.name)
    assert not rep.is_replicated(out.name)
    assert "test_opaque_op, which the replication analysis does not understand" in rep.reason(out.name)
