"""Storage-aware memory model and compaction of saved views, on a LitGPT-style attention block under the executors
of Thunder's benchmark (``torch_compile_cat_ex`` first; on the CPU its twin without the CUDA check).

Under those executors the qkv split, views, transposes and the RoPE's ``cat`` are one torch.compile region, which
returns ``v`` as a view of its input ``qkv``: the saved ``v`` keeps all of ``qkv`` alive. The model must count the
storage (the plan's saved bytes equal the distinct storages autograd saves, with and without the pass), and
``CompactSavedViews`` (alone, no distributed setup) replaces ``v`` by a compact copy, bitwise exact.
"""

from __future__ import annotations

import pytest
import torch

from thunder_fp8shard.analysis.aliasing import is_torch_compile_region, region_aliasing
from thunder_fp8shard.reporting.plan_text import plan_text
from thunder_fp8shard.testing.measure import saved_bytes
from thunder_fp8shard.testing.toy_models import FakeFP8Llama

N_EMBD, N_HEAD, SEQ, BATCH = 64, 4, 32, 2
QKV_BYTES = BATCH * SEQ * 3 * N_EMBD * 4  # f32
V_BYTES = QKV_BYTES // 3


def _train(transforms, *, steps=2, rope=True):
    import thunder

    from thunder_fp8shard.testing.executors import benchmark_executors

    torch.manual_seed(0)
    model = FakeFP8Llama(1, n_embd=N_EMBD, n_head=N_HEAD, rope=rope)
    jm = thunder.jit(model, executors=benchmark_executors("cpu"), transforms=transforms)
    gen = torch.Generator().manual_seed(1)
    saved, grads = [], []
    for _ in range(steps):
        idx = torch.randint(0, 256, (BATCH, SEQ), generator=gen)
        with saved_bytes() as sb:
            out = jm(idx)
        out.float().pow(2).mean().backward()
        saved.append(sb.total)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    entry = thunder.compile_stats(jm).interpreter_cache[0]
    return saved, grads, entry


@pytest.fixture(scope="module")
def runs():
    from thunder_fp8shard import CompactSavedViews

    base = _train([])
    compact = CompactSavedViews(optimizer_states=0)
    with_pass = _train([compact])
    return base, with_pass, compact


def test_the_region_returns_v_as_a_view_of_qkv_and_the_model_counts_qkv(runs):
    (_, _, entry), _, _ = runs
    fw = entry.computation_traces[-1]
    regions = [b for b in fw.bound_symbols if is_torch_compile_region(b)]
    views = {out: inp for b in regions for out, inp in region_aliasing(b).views_of.items()}
    assert len(views) == 1, views  # v, a view of the region's input qkv
    (v, qkv), = views.items()
    from thunder_fp8shard.analysis.liveness import storage_lives, storage_of

    life = storage_of(storage_lives(fw, entry.backward_traces[-1]))[v]
    assert life.name == qkv and life.nbytes == QKV_BYTES and v in life.members


def test_plan_saved_bytes_are_the_distinct_storages_measured_with_and_without_the_pass(runs):
    (base_saved, _, _), (saved, _, _), compact = runs
    plan = compact.plans[0]
    assert (plan.saved_bytes_before, plan.saved_bytes_after) == (base_saved[0], saved[0])
    assert base_saved[0] - saved[0] == QKV_BYTES - V_BYTES  # the rest of qkv, freed
    audit = compact.reports[0].saved
    assert (audit.measured_saved_bytes, audit.predicted_saved_bytes, audit.differences) == (saved[0], saved[0], ())


def test_compact_saved_views_alone_copies_v_and_is_bitwise_exact(runs):
    (_, base_grads, _), (_, grads, entry), compact = runs
    plan = compact.plans[0]
    (c,) = plan.compactions
    assert c.compacted and c.storage_nbytes == QKV_BYTES and c.member_nbytes == (V_BYTES,)
    assert (c.freed_bytes, c.copied_bytes, plan.compacted_bytes_per_step) == (2 * V_BYTES, V_BYTES, V_BYTES)
    assert plan.operator_calls["fp8shard_compact"] == 1 and not plan.buckets and not plan.decisions
    text = plan_text(plan)
    assert "CompactSavedViews plan" in text and "1 of 1 storages compacted" in text and c.members[0] in text
    assert "fp8shard_compact" in str(entry.computation_traces[-1])
    for step, (a, b) in enumerate(zip(base_grads, grads)):
        assert a.keys() == b.keys()
        for n in a:
            assert torch.equal(a[n], b[n]), f"step {step}: gradient of {n} differs"
            assert a[n].abs().sum() > 0, f"step {step}: gradient of {n} is zero: the comparison would be void"


def test_compaction_keeps_the_views_dimension_order():
    from thunder_fp8shard.runtime import ops

    qkv = torch.randn(2, 32, 3 * 64)
    v = qkv[..., 128:].view(2, 32, 4, 16).transpose(1, 2)
    (copy,) = ops._compact((v,))
    assert torch.equal(copy, v) and copy.untyped_storage().nbytes() == v.numel() * 4
    assert sorted(range(4), key=lambda d: -copy.stride(d)) == sorted(range(4), key=lambda d: -v.stride(d))
    assert copy.is_contiguous() is False and copy.transpose(1, 2).is_contiguous()


def test_a_region_that_takes_one_tensor_twice_is_replayed(runs):
    """Under Thunder FSDP LitGPT's RoPE region takes ``cos`` and ``sin`` twice (for q and for k): the replay takes
    each tensor once (a function cannot have two parameters of one name; the H200 run of 2026-12-02 lost the
    compaction of every layer's ``v`` to that)."""
    (_, _, entry), _, _ = runs
    fw = entry.computation_traces[-1]
    (region,) = [b for b in fw.bound_symbols if is_torch_compile_region(b) and region_aliasing(b).views_of]
    twice = region.from_bsym(args=(*region.args, *[a for a in region.args if hasattr(a, "name")][-1:]))
    assert len({a.name for a in twice.args}) < len(twice.args)
    assert region_aliasing(twice) == region_aliasing(region)
