"""Pass-level tests of the rewrite: where the shards and the gathers land, buckets, dels and the saved lists."""

import pytest
from thunder.core import dtypes
from thunder.core.prims import PrimIDs
from thunder.core.proxies import AnyProxy, TensorProxy
from thunder.executors.pythonex import clear_mutable_collection

from thunder_fp8shard.runtime import ops
from thunder_fp8shard.analysis.candidates import find_candidates
from thunder_fp8shard.planning.grouping import place
from thunder_fp8shard.planning.layout import bucket_layout
from thunder_fp8shard.memory.model import memory_model
from thunder_fp8shard.plan import Decision, ShardPlan
from thunder_fp8shard.rewrite.traces import operator_calls, requests, rewrite_backward, rewrite_forward
from thunder_fp8shard.analysis.program import program_facts
from thunder_fp8shard.analysis.saved import backward_saved, forward_saved

WORLD = 2


def _weight_copies(fw):
    return [p for p in forward_saved(fw)[0] if p.dtype == dtypes.float8_e4m3fn and p.shape[0] != 3]


def _plan(fw, bw, prefetch: int, together: bool, one_op: bool = False) -> ShardPlan:
    """A plan sharding the weight copies: one bucket and one shard op a tensor; one bucket of all (``together``); or
    a bucket a tensor, all kept by one shard op (``one_op``), placed on the memory model as the planner places them."""
    copies = {p.name for p in _weight_copies(fw)}
    facts = program_facts(fw, bw, set())
    candidates = [c for c in find_candidates(facts.saved, "fp8", set()) if c.name in copies]
    model = memory_model(facts, candidates)
    decisions = [Decision(c.name, tuple(c.proxy.shape), "float8_e4m3fn", "float8", c.payload_bytes, True, True, "", 0)
                 for c in sorted(candidates, key=lambda c: model.placements[c.name].first_use)]
    groups = [decisions] if together else [[d] for d in decisions]
    ops_of = [0] * len(groups) if one_op or together else list(range(len(groups)))
    buckets = place(groups, ops_of, model, prefetch=prefetch, k=WORLD)
    return ShardPlan.of(world_size=WORLD, method="slice", policy="all", prefetch=prefetch, decisions=decisions,
                     saved_bytes_before=0, saved_bytes_after=0, buckets=buckets)


def _rewrite(fsdp_traces, prefetch, together=False, one_op=False):
    fw, bw, group = fsdp_traces
    plan = _plan(fw, bw, prefetch, together, one_op)
    facts = program_facts(fw, bw, set())
    shard_ops, compactions = requests(plan, facts)
    new_fw = rewrite_forward(facts, shard_ops, group=group, k=WORLD, method="slice", verify=False,
                             compactions=compactions, provenance="fwd test")
    new_bw, gathers = rewrite_backward(bw, new_fw, group=group, provenance="bwd test")
    return fw, bw, new_fw, new_bw, gathers


def _uses(bsym):
    return {p.name for p in bsym.flat_proxy_args}


def _assert_no_use_after_del(trace):
    deleted = set()
    for b in trace.bound_symbols:
        assert not (_uses(b) & deleted) or b.sym.id == PrimIDs.DEL, f"{b.sym.name} uses a deleted proxy"
        if b.sym.id == PrimIDs.DEL:
            deleted |= _uses(b)


@pytest.mark.parametrize("together", [False, True])
def test_forward_saves_one_uint8_shard_per_bucket_right_after_its_members_last_forward_use(fsdp_traces, together):
    fw, _, new_fw, _, _ = _rewrite(fsdp_traces, prefetch=1, together=together)
    bsyms = new_fw.trace.bound_symbols
    assert new_fw.trace.get_provenance().pss == "fwd test"
    assert len(new_fw.sharded) == (1 if together else 3)
    for s in new_fw.sharded:
        names = {p.name for p in s.originals}
        (at,) = [i for i, b in enumerate(bsyms) if b.sym is ops.shard and {p.name for p in b.flat_proxy_args} == names]
        # no use of the full tensors after the shard op except their dels, and they are deleted
        later = [b for b in bsyms[at + 1 :] if _uses(b) & names]
        assert {b.sym.id for b in later} == {PrimIDs.DEL} and set().union(*map(_uses, later)) >= names
        last_real_use = max(i for i, b in enumerate(bsyms[:at]) if _uses(b) & names and b.sym.id != PrimIDs.DEL)
        assert all(b.sym.id == PrimIDs.DEL for b in bsyms[last_real_use + 1 : at])
        lay = bucket_layout([p.numel for p in s.originals], WORLD)
        assert s.shard.dtype == dtypes.uint8 and s.shard.shape == (lay.shard_nbytes,)
    if together:  # (64, 24), (45, 64), (7, 45) at bytes 0, 1536, 4608 (aligned up from 4416): 4923 B -> 2462 per rank
        assert new_fw.sharded[0].shard.shape == (2462,)
    else:  # the (7, 45) weight (315 B) is padded to 2 x 158
        assert {s.shard.shape for s in new_fw.sharded} == {(768,), (1440,), (158,)}
    saved_tensors, saved_other = forward_saved(new_fw.trace)
    names = {p.name for p in saved_tensors}
    assert all(s.shard.name in names and not {p.name for p in s.originals} & names for s in new_fw.sharded)
    assert [p.name for p in saved_other] == [s.restorer.name for s in new_fw.sharded]
    assert all(isinstance(p, AnyProxy) for p in saved_other)
    _assert_no_use_after_del(new_fw.trace)


@pytest.mark.parametrize("together", [False, True])
def test_saved_lists_keep_their_positional_contract(fsdp_traces, together):
    fw, _, new_fw, new_bw, _ = _rewrite(fsdp_traces, prefetch=1, together=together)
    fw_t, fw_o = forward_saved(new_fw.trace)
    bw_t, bw_o = backward_saved(new_bw)
    assert [p.name for p in fw_t] == [p.name for p in bw_t]
    assert [p.name for p in fw_o] == [p.name for p in bw_o]
    assert len(fw_t) == len(forward_saved(fw)[0]) - sum(len(s.originals) for s in new_fw.sharded) + len(new_fw.shards)


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_backward_waits_just_before_the_first_consumer_and_gathers_prefetch_ahead(fsdp_traces, prefetch):
    fw, bw, new_fw, new_bw, gathers = _rewrite(fsdp_traces, prefetch)
    bsyms = new_bw.bound_symbols
    waiting = (ops.gather_wait, ops.gather_next)
    waits = [i for i, b in enumerate(bsyms) if b.sym in waiting]
    assert len(waits) == len(gathers) == 3
    consumers = []
    for w in waits:
        restored = [p for p in bsyms[w].flat_proxy_outs if isinstance(p, TensorProxy)]
        assert len(restored) == 1 and restored[0].dtype == dtypes.float8_e4m3fn  # original shape and dtype come back
        first = next(i for i, b in enumerate(bsyms) if restored[0].name in _uses(b))
        assert first > w and all(b.sym.id == PrimIDs.DEL or b.sym in (ops.gather_start, *waiting) for b in bsyms[w + 1 : first])
        consumers.append(first)
    # the j-th gather is issued before the consumer of the (j - prefetch)-th, or at the top of the backward
    bookkeeping = lambda b: b.sym.id == PrimIDs.DEL or "UNPACK" in str(b.sym.id) or b.sym is clear_mutable_collection  # noqa: E731
    body_start = next(i for i, b in enumerate(bsyms) if not bookkeeping(b))
    for j, g in enumerate(gathers):
        if prefetch == 0:
            assert bsyms[g].sym is ops.gather_start and all(b.sym.id == PrimIDs.DEL for b in bsyms[g + 1 : waits[j]])
        elif j >= prefetch:
            # issued by the (j - prefetch)-th bucket's wait: one call waits for that one and starts this one
            assert g == waits[j - prefetch] and bsyms[g].sym is ops.gather_next and g < consumers[j - prefetch]
            assert bsyms[g].output[-1] is bsyms[waits[j]].args[0]  # the handle it makes is the one waited for
        else:  # at the top of the backward body, before any computation
            assert bsyms[g].sym is ops.gather_start
            assert all(b.sym is ops.gather_start or b.sym.id == PrimIDs.DEL for b in bsyms[body_start:g])
        assert g < waits[j]
    # one call a bucket after the first prefetch ones: a start each, then waits that start the next
    assert [b.sym for b in bsyms if b.sym in (ops.gather_start, *waiting)] == (
        [ops.gather_start, ops.gather_wait] * 3 if prefetch == 0
        else [ops.gather_start] * prefetch + [ops.gather_next] * (3 - prefetch) + [ops.gather_wait] * prefetch)
    # what the plan reports: the calls a step, counted in the traces (three shard ops: one tensor a bucket)
    fused = 0 if prefetch == 0 else 3 - prefetch
    assert operator_calls(new_fw.trace, new_bw) == {
        "fp8shard_shard": 3, "fp8shard_gather_start": 3 - fused, "fp8shard_gather_next": fused,
        "fp8shard_gather_wait": 3 - fused, "fp8shard_compact": 0, "fp8shard_audit": 0, "fp8shard_calibrate": 0}
    assert sum(b.sym is clear_mutable_collection for b in bsyms) >= 3  # saved lists and cotangents are cleared
    _assert_no_use_after_del(new_bw)
    assert new_bw.get_provenance().pss == "bwd test"


def test_a_bucket_is_gathered_once_and_restores_all_its_members_before_the_first_of_them_is_used(fsdp_traces):
    _, _, new_fw, new_bw, gathers = _rewrite(fsdp_traces, prefetch=1, together=True)
    bsyms = new_bw.bound_symbols
    (w,) = [i for i, b in enumerate(bsyms) if b.sym is ops.gather_wait]
    assert len(gathers) == 1 and gathers[0] < w
    restored = {p.name for p in bsyms[w].flat_proxy_outs}
    assert restored == {p.name for p in new_fw.sharded[0].originals}
    first = min(i for i, b in enumerate(bsyms) if _uses(b) & restored)
    assert w < first and all(b.sym.id == PrimIDs.DEL for b in bsyms[w + 1 : first])
    assert str(bsyms[w].output[0].name) in str(new_bw)  # the tuple-returning wait prints and runs as Python
    _assert_no_use_after_del(new_bw)


def test_one_shard_op_keeps_several_buckets_in_one_tensor_and_each_is_gathered_from_its_offset(fsdp_traces):
    fw, _, new_fw, new_bw, gathers = _rewrite(fsdp_traces, prefetch=1, one_op=True)
    fwd = new_fw.trace.bound_symbols
    (op,) = [b for b in fwd if b.sym is ops.shard]
    (shard,) = new_fw.shards
    assert len(new_fw.sharded) == 3 and all(s.shard is shard for s in new_fw.sharded)
    # (64, 24), (45, 64), (7, 45): shards of 768, 1440 and 158 bytes, packed
    assert [(s.shard_offset, s.shard_nbytes) for s in new_fw.sharded] == [(0, 768), (768, 1440), (2208, 158)]
    assert shard.shape == (2366,) and op.flat_proxy_outs[0] is shard
    # after the last forward use of all members; the saved list holds the one shard and a restorer a bucket
    saved_tensors, saved_other = forward_saved(new_fw.trace)
    assert [p.name for p in saved_tensors].count(shard.name) == 1
    assert [p.name for p in saved_other] == [s.restorer.name for s in new_fw.sharded]
    # a gather's (shard, offset, bytes): a start's first three arguments, a next's three after the wait's two
    issued = [b.args[:3] if b.sym is ops.gather_start else b.args[2:5] for b in map(new_bw.bound_symbols.__getitem__, gathers)]
    assert len(issued) == 3
    assert sorted((offset, n) for _, offset, n in issued) == [(0, 768), (768, 1440), (2208, 158)]
    assert all(s.name == shard.name for s, _, _ in issued)
    _assert_no_use_after_del(new_fw.trace)
    _assert_no_use_after_del(new_bw)


def test_a_compaction_the_plan_gives_a_shard_op_is_made_by_that_op_in_one_call(fsdp_traces):
    """A compaction placed on shard op 0 (``Compaction.shard_op``): no ``fp8shard_compact`` call of its own; the op
    takes the views as its third argument, returns their copies after its restorers, and the copies are saved."""
    from dataclasses import replace

    from thunder_fp8shard.plan import Compaction

    fw, bw, group = fsdp_traces
    plan = _plan(fw, bw, prefetch=1, together=False)
    first = min(plan.buckets, key=lambda b: b.shard_op)
    copies = {p.name for p in _weight_copies(fw)}
    view = next(p for p in forward_saved(fw)[0] if p.name not in copies and p.ndim == 2)  # any saved tensor will do
    c = Compaction("s", (view.name,), (tuple(view.shape),), ("float32",), (0,), 1, first.shard_at, (len(fw.bound_symbols),),
                   compacted=True, shard_op=first.shard_op)
    for placed, expected_compact_calls in ((c, 0), (replace(c, shard_op=None), 1)):
        p = plan.replaced(compactions=[placed])
        facts = program_facts(fw, bw, set())
        shard_ops, compactions = requests(p, facts)
        new_fw = rewrite_forward(facts, shard_ops, group=group, k=WORLD, method="slice", verify=False,
                                 compactions=compactions, provenance="fwd test")
        new_bw, _ = rewrite_backward(bw, new_fw, group=group, provenance="bwd test")
        calls = operator_calls(new_fw.trace, new_bw)
        assert calls["fp8shard_compact"] == expected_compact_calls and calls["fp8shard_shard"] == len(plan.buckets)
        ((v, copy),) = new_fw.compacted
        assert v.name == view.name
        (maker,) = [b for b in new_fw.trace.bound_symbols if copy.name in {o.name for o in b.flat_proxy_outs}]
        saved = {x.name for x in forward_saved(new_fw.trace)[0]}
        assert copy.name in saved and view.name not in saved
        if expected_compact_calls == 0:
            assert maker.sym is ops.shard and maker.args[2] == (v,) and maker.flat_proxy_outs[-1].name == copy.name
            assert {x.name for x in maker.args[0][0]} <= copies
        else:
            assert maker.sym is ops.compact and len(maker.args) == 2
        _assert_no_use_after_del(new_fw.trace)
