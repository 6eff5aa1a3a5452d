"""``fp8_forward_gather`` on the CPU, without TransformerEngine (thunder_fp8shard.rewrite.fp8_gather): which TE linear weights
are gathered in FP8 and why the others are not, on synthetic forward traces shaped like Thunder FSDP ZeRO-3 + TE's
executor (``all_gather -> wait [-> slice] -> te_functional_linear_fwd``, the recipe/state/quantizer getters); the
mechanical rewrite; the plan's rows and bytes; the recipe check the run-time fallback shares; and that a real Thunder
FSDP trace without TE is left alone. The GPU tests (``tests/test_te_gpu.py::test_fp8_forward_all_gather_*``) settle
exactness."""

from __future__ import annotations

import pytest
from thunder.core import devices, dtypes, prims
from thunder.core.prims import PrimIDs
from thunder.core.proxies import AnyProxy, TensorProxy
from thunder.core.trace import TraceCtx, from_trace, tracectx
from thunder.extend import OperatorExecutor

from thunder_fp8shard.reporting.plan_text import plan_text
from thunder_fp8shard.rewrite import fp8_gather
from thunder_fp8shard.runtime.fp8_gather_ops import WeightGatherSpec, exact_recipe
from thunder_fp8shard.plan import ShardPlan

_fake = OperatorExecutor("fp8shard_test_fake_fsdp_te")
GROUP, OTHER_GROUP = object(), object()
CPU = devices.to_device("cpu")


def _t(name, shape, dtype=dtypes.bfloat16):
    return TensorProxy(name, shape=shape, dtype=dtype, device=CPU, requires_grad=False)


def _gather_meta(a, group, do_async, dim=None):
    return AnyProxy(None, prefix="fut")


def _wait_meta(fut):
    return _t(None, (0, 0))  # rebound with explicit outputs below


def _slice_meta(a, start, end, strides=None):
    return _t(None, tuple(e - s for s, e in zip(start, end)))


def _linear_meta(a, w, bias, q_in, q_w):
    return _t(None, (*a.shape[:-1], w.shape[0])), _t(None, a.shape), _t(None, w.shape)


_sym = {
    "gather": _fake.register_operator("torch_all_gather_prim_impl", meta=_gather_meta, fn=lambda *a: None),
    "wait": _fake.register_operator("torch_wait_prim_impl", meta=_wait_meta, fn=lambda *a: None),
    "slice": _fake.register_operator("torch_slice_prim_impl", meta=_slice_meta, fn=lambda *a: None),
    "recipe": _fake.register_operator("get_te_fp8_recipe_0", meta=lambda: AnyProxy(None, prefix="r"),
                                      fn=lambda: None),
    "linear": _fake.register_operator("te_functional_linear_fwd", meta=_linear_meta, fn=lambda *a: None),
    "use": _fake.register_operator("some_torch_op", meta=lambda a: _t(None, a.shape), fn=lambda a: a),
    "update": _fake.register_operator("te_fp8_amax_and_scale_update",
                                      meta=lambda r, *, states, tokens: tuple(_t(None, t.shape) for t in tokens),
                                      fn=lambda r, *, states, tokens: tokens),
}


def _state_sym(k):
    return _fake.register_operator(f"get_te_fp8_state_{k}", meta=lambda r, mode, n: AnyProxy(None, prefix="s"),
                                   fn=lambda *a: None)


def _quantizers_sym(k):
    return _fake.register_operator(f"get_te_fp8_quantizers_{k}",
                                   meta=lambda s, n: tuple(AnyProxy(None, prefix="q") for _ in range(n)),
                                   fn=lambda *a: None)


_states = [_state_sym(k) for k in range(8)]
_quantizers = [_quantizers_sym(k) for k in range(8)]


def forward(weights, *, n=2, group=GROUP, pad=None, extra_use=False, save_weight=False, mode="forward",
            quantizer_index=1, slice_end=None, batch=4, update=True, update_before=False, sorted_waits=False,
            between=None):
    """A forward trace: for each ``(out, in)`` in ``weights`` a parameter shard input (``ceil(out/n)`` rows), its
    all-gather over ``group``, the wait, the unpad slice where ``n`` does not divide ``out`` (``pad=True`` forces
    one, ``slice_end`` replaces its end), the linear's state and quantizers, the TE linear. ``sorted_waits``: every
    all-gather at the top (each after its argument's unpack), then the recipe getter, as Thunder's ``sort_waits``
    leaves them (else each all-gather right before its wait); ``between``: indices of weights whose all-gather is preceded by a compute op (only with
    ``sorted_waits``). Returns the trace and the shard proxies."""
    trace = TraceCtx()
    body = []
    trace.bound_symbols = body
    with tracectx(trace):
        x = _t("x", (batch, weights[0][1]))
        shards = [_t(f"t_w{i}", (-(-out // n), cols)) for i, (out, cols) in enumerate(weights)]
        trace.args = (x, *shards)
        futs = {}
        if sorted_waits:
            for i, shard in enumerate(shards):
                if between and i in between:
                    _sym["use"](x)
                # as in Thunder's traces, each argument's unpack right before its all-gather
                body.append(prims.unpack_trivial.bind(shard, name=shard.name, output=shard))
                futs[i] = _sym["gather"](shard, group, True, None)
        r = _sym["recipe"]()
        saved = []
        h = x
        for i, ((out, cols), shard) in enumerate(zip(weights, shards)):
            rows = shard.shape[0]
            fut = futs[i] if sorted_waits else _sym["gather"](shard, group, True, None)
            full = _t(f"w_full{i}", (rows * n, cols))
            body.append(_sym["wait"].bind(fut, output=full))
            w = full
            if pad or rows * n != out or slice_end is not None:
                w = _sym["slice"](full, [0, 0], [slice_end or out, cols], [1, 1])
            s = _states[i](r, mode, 2)
            qs = _quantizers[i](s, 2)
            if update_before:
                _sym["update"](r, states=(s,), tokens=(h,))
            y, qa, qw = _sym["linear"](h, w, None, qs[0], qs[quantizer_index])
            if update:
                y, qa, qw = _sym["update"](r, states=(s,), tokens=(y, qa, qw))
            if extra_use:
                _sym["use"](w)
            saved += [qa, qw] + ([w] if save_weight else [])
            h = y
        prims.python_return(h, (tuple(saved), (r,)))
    return trace, shards


def _facts(trace, bw=None):
    """The program's facts, with a backward that only returns where the test has none."""
    from thunder_fp8shard.analysis.program import program_facts

    if bw is None:
        bw = TraceCtx()
        with tracectx(bw):
            prims.python_return(None)
    return program_facts(trace, bw, set())


def _sites(trace, bw=None, *, n=2, recipe_problem=None, default=None, group=GROUP):
    return fp8_gather.find_sites(_facts(trace, bw), group=group, world_size=n, default_world_size=default or n,
                                 recipe_problem=recipe_problem)


def test_eligible_weights_without_padding():
    trace, shards = forward([(64, 32), (48, 64)])
    sites = _sites(trace)
    assert [s.why for s in sites] == [None, None]
    assert [s.shard.name for s in sites] == ["t_w0", "t_w1"] and all(s.slice is None for s in sites)


def test_padded_weight_is_eligible_through_its_unpad_slice():
    trace, _ = forward([(40, 32)], n=3)  # 14 rows a rank, 2 padding rows on the last
    (site,) = _sites(trace, n=3)
    assert site.why is None and site.slice is not None
    (row,) = fp8_gather.decisions([site], 3)
    assert row.received_bytes_before == 42 * 32 * 2 * 2 // 3 and row.received_bytes_after == 42 * 32 * 2 // 3
    assert row.cast_elements_before == 40 * 32 and row.cast_elements_after == 14 * 32


@pytest.mark.parametrize("case, kwargs, reason", [
    ("second consumer", dict(extra_use=True), "another use (some_torch_op)"),
    ("saved weight", dict(save_weight=True), "returned or saved for backward"),
    ("other group", dict(group=OTHER_GROUP), "process group other than FSDP's"),
    ("backward state", dict(mode="backward"), "does not come from a forward TE state"),
    ("input quantizer", dict(quantizer_index=0), "not output 1"),
    ("odd slice", dict(slice_end=60), "other than dropping its padding rows"),
    ("no scale update", dict(update=False), "no te_fp8_amax_and_scale_update of the linear's state follows it"),
    ("scale update before", dict(update_before=True), "te_fp8_amax_and_scale_update of the linear's state precedes"),
])
def test_refusals_name_their_reason(case, kwargs, reason):
    trace, _ = forward([(64, 32)], **kwargs)
    (site,) = _sites(trace)
    assert site.why is not None and reason in site.why, (case, site.why)
    (row,) = fp8_gather.decisions([site], 2)
    assert not row.fp8 and row.reason == site.why and row.received_bytes_after == row.received_bytes_before
    assert fp8_gather.rewrite(trace, [site], group=GROUP, world_size=2, rank=0, provenance="x") is trace


def test_refused_when_a_rank_holds_no_row():
    trace, _ = forward([(8, 32)], n=6)  # ceil(8/6) = 2 rows a rank: ranks 4 and 5 hold none
    (site,) = _sites(trace, n=6)
    assert "a rank would hold no valid row" in site.why


def test_refused_recipe_recompute_world_and_one_rank():
    trace, _ = forward([(64, 32)])
    why = exact_recipe(type("DelayedScaling", (), {"reduce_amax": False})())
    assert "reduce_amax=False" in why
    assert _sites(trace, recipe_problem=why)[0].why == why
    assert "FSDP's group has 2 ranks" in _sites(trace, default=4)[0].why
    bw, _ = forward([(64, 32)])  # any TE linear forward in the backward: activation checkpointing
    assert "recomputed in the backward" in _sites(trace, bw)[0].why
    assert "one rank" in fp8_gather.find_sites(_facts(trace), group=GROUP, world_size=1, default_world_size=1,
                                               recipe_problem=None)[0].why


def test_recipe_check():
    class DelayedScaling:
        reduce_amax = True

    class MXFP8BlockScaling:
        pass

    assert exact_recipe(DelayedScaling()) is None
    assert "not DelayedScaling" in exact_recipe(MXFP8BlockScaling())
    assert exact_recipe(None) == "no FP8 recipe"


def _names(trace):
    return [b.sym.name for b in trace.bound_symbols if b.sym.id != PrimIDs.DEL]


THUNDER_CALLS = {"torch_all_gather_prim_impl", "torch_wait_prim_impl", "torch_slice_prim_impl",
                 "te_functional_linear_fwd"}


@pytest.mark.parametrize("sorted_waits", [False, True], ids=["gathers-apart", "sort_waits"])
def test_rewrite_replaces_gather_wait_slice_and_linear(sorted_waits):
    """Each eligible weight's all-gather, wait, unpad slice and TE linear go; a batched start (one per run of adjacent
    all-gathers) and a fused linear bound to the linear's own outputs come in; the fused linear gets the linear's
    input, bias, quantizers, the start's handle for its weight, and a spec with the rows, shapes and the linear's
    Python implementation; the quantizer getters a start needs come before it."""
    trace, shards = forward([(64, 32), (40, 32)], n=3, sorted_waits=sorted_waits)  # the second is padded
    sites = _sites(trace, n=3)
    assert [s.why for s in sites] == [None, None]
    new = fp8_gather.rewrite(trace, sites, group=GROUP, world_size=3, rank=2, provenance="test")
    names = _names(new)
    assert not THUNDER_CALLS & set(names), names
    assert names.count("fp8shard_weight_gather_starts") == (1 if sorted_waits else 2)
    assert names.count("fp8shard_te_linear_fwd") == 2
    body = [b for b in new.bound_symbols if b.sym.id != PrimIDs.DEL]
    starts = [b for b in body if b.sym.name == "fp8shard_weight_gather_starts"]
    handle_of = {h.name: (b, j) for b in starts for j, h in enumerate(b.output)}
    for site in sites:
        (lin,) = [b for b in body if b.sym.name == "fp8shard_te_linear_fwd" and b.output is site.linear.output]
        x, h, bias, q_in, q_w, spec = lin.args
        assert (x, bias, q_in, q_w) == (site.linear.args[0], site.linear.args[2], *site.linear.args[3:5])
        start, j = handle_of[h.name]
        assert start.args[0][j] is site.shard and start.args[1][j] is q_w and start.args[3].specs[j] is spec
        assert body.index(start) < body.index(lin)
        for g in (site.quantizers, *[b for b in body if b.output is site.quantizers.args[0]]):  # quantizers, state
            assert body.index(g) < body.index(start), (g.sym.name, names)
        assert (spec.rows, spec.out_features, spec.in_features, spec.rank) == (-(-site.weight.shape[0] // 3),
                                                                              site.weight.shape[0], 32, 2)
        assert spec.linear is site.linear._call_ctx["te_functional_linear_fwd"]
        assert body[body.index(lin) + 1].sym.name == "te_fp8_amax_and_scale_update"  # as after the linear
    padded = [b.args[5] for b in body if b.sym.name == "fp8shard_te_linear_fwd"][1]
    assert (padded.rows, padded.valid_rows, padded.padded, padded.trimmed) == (14, 12, True, True)  # rows 28..39 of 40
    assert fp8_gather.operator_calls(new) == {"fp8shard_weight_gather_starts": 1 if sorted_waits else 2,
                                              "fp8shard_te_linear_fwd": 2}
    assert new.bound_symbols[-1].sym.id == PrimIDs.RETURN and trace.bound_symbols is not new.bound_symbols
    assert _names(trace).count("te_functional_linear_fwd") == 2  # the input trace is untouched


def test_one_start_call_per_run_of_adjacent_all_gathers():
    """Thunder's ``sort_waits`` leaves every forward all-gather at the top: one start call serves them all. A compute
    op between two all-gathers splits the run (the later ones cannot move above it, nor it below them)."""
    weights = [(64, 32)] * 5
    trace, _ = forward(weights, sorted_waits=True)
    new = fp8_gather.rewrite(trace, _sites(trace), group=GROUP, world_size=2, rank=0, provenance="t")
    (start,) = [b for b in new.bound_symbols if b.sym.name == "fp8shard_weight_gather_starts"]
    assert [t.name for t in start.args[0]] == [f"t_w{i}" for i in range(5)] and len(start.output) == 5
    assert len(start.args[3].specs) == 5
    names = _names(new)
    # the recipe, state and quantizer getters moved up before the start, in their order; nothing else before it
    before = [n for n in names[:names.index("fp8shard_weight_gather_starts")] if n != "unpack_trivial"]
    assert before == ["get_te_fp8_recipe_0"] + [g for i in range(5) for g in (f"get_te_fp8_state_{i}",
                                                                              f"get_te_fp8_quantizers_{i}")], before
    split, _ = forward(weights, sorted_waits=True, between={3})
    new = fp8_gather.rewrite(split, _sites(split), group=GROUP, world_size=2, rank=0, provenance="t")
    runs = [[t.name for t in b.args[0]] for b in new.bound_symbols if b.sym.name == "fp8shard_weight_gather_starts"]
    assert runs == [["t_w0", "t_w1", "t_w2"], ["t_w3", "t_w4"]]
    names = _names(new)
    first, second = [i for i, name in enumerate(names) if name == "fp8shard_weight_gather_starts"]
    assert first < names.index("some_torch_op") < second, names


@pytest.mark.parametrize("padded", [False, True])
def test_run_time_calls_per_weight_fewer_than_thunders(padded):
    """Per weight gathered in FP8, the forward calls at most one operator plus its share of a batched start, where
    Thunder called three (all-gather, wait, TE linear) or four (and the unpad slice); the plan counts both."""
    n_weights, n = 6, 3
    out = 40 if padded else 48
    trace, _ = forward([(out, 32)] * n_weights, n=n, sorted_waits=True)
    thunder = sum(name in THUNDER_CALLS for name in _names(trace))
    assert thunder == n_weights * (4 if padded else 3)

    class DelayedScaling:
        reduce_amax = True

    fg = fp8_gather.plan(_facts(trace), enabled=True, setup_name="Thunder FSDP (ZeRO-3)", group=GROUP, world_size=n,
                         recipe=DelayedScaling(), default_world_size=n, rank=0)
    new = fg.apply(trace)
    calls = fp8_gather.operator_calls(new)
    assert calls == {"fp8shard_weight_gather_starts": 1, "fp8shard_te_linear_fwd": n_weights}
    assert not THUNDER_CALLS & set(_names(new))
    assert sum(calls.values()) == n_weights + 1 <= n_weights * 3
    assert fg.calls_replaced == thunder
    plan = ShardPlan.of(world_size=n, method="slice", policy="all", prefetch=1, decisions=[], saved_bytes_before=0,
                     saved_bytes_after=0, forward_gather=list(fg.rows),
                     forward_gather_calls=(fg.calls_replaced, sum(calls.values())))
    assert f"run-time calls for them {thunder} -> {n_weights + 1}" in plan_text(plan)


def test_spec_refuses_impossible_row_counts():
    with pytest.raises(ValueError, match="0 valid of 2 rows"):
        WeightGatherSpec(None, 6, 5, 2, 0, 8, 32, None, "w")


def test_plan_is_off_by_default_and_a_no_op_outside_thunder_fsdp():
    trace, _ = forward([(64, 32)])
    off = fp8_gather.plan(_facts(trace), enabled=False, setup_name="Thunder FSDP (ZeRO-3)", group=GROUP, world_size=2)
    assert off.sites == () and off.rows == () and off.apply(trace) is trace
    ddp = fp8_gather.plan(_facts(trace), enabled=True, setup_name="Thunder DDP", group=GROUP, world_size=2)
    assert ddp.sites == () and ddp.rows == ()  # silent where it does not apply


def test_plan_rows_bytes_and_text():
    trace, _ = forward([(64, 32), (48, 64)])

    class DelayedScaling:
        reduce_amax = True

    fg = fp8_gather.plan(_facts(trace), enabled=True, setup_name="Thunder FSDP (ZeRO-3)", group=GROUP, world_size=2,
                         recipe=DelayedScaling(), default_world_size=2, rank=1)
    assert [r.fp8 for r in fg.rows] == [True, True]
    plan = ShardPlan.of(world_size=2, method="slice", policy="all", prefetch=1, decisions=[], saved_bytes_before=0,
                     saved_bytes_after=0, forward_gather=list(fg.rows))
    numel = 64 * 32 + 48 * 64
    assert plan.forward_gather_bytes == (numel * 2 // 2, numel // 2)  # (N-1)/N of bf16, then of uint8
    assert plan.forward_cast_elements == (numel, numel // 2)
    assert "2 of 2 in FP8" in plan_text(plan) and "forward all-gather of TE linear weights" in plan_text(plan)
    new = fg.apply(trace)
    assert "2 TE linear weight(s) all-gathered in FP8" in str(new.get_provenance())


def test_the_memory_model_counts_weights_gathered_in_fp8_at_their_bytes():
    """Each weight gathered in FP8 holds, from its all-gather to its linear, the uint8 gathered rows and this rank's
    cast rows (1 B an element) where the trace prints the bf16 gather: the model counts that in every evaluation but
    the program as Thunder made it (the run without the pass); a weight left in bf16 keeps its size."""
    from thunder_fp8shard.memory.model import memory_model
    from thunder_fp8shard.options import ShardOptions
    from thunder_fp8shard.planning.planner import choose

    class DelayedScaling:
        reduce_amax = True

    n = 2
    trace, _ = forward([(64, 32), (48, 64), (39, 16)], n=n)  # the third padded: 2 x 20 rows gathered, 39 kept
    fg = fp8_gather.plan(_facts(trace), enabled=True, setup_name="Thunder FSDP (ZeRO-3)", group=GROUP, world_size=n,
                         recipe=DelayedScaling(), default_world_size=n, rank=0)
    items = fg.resized()  # the resize items it offers the planner, by weight
    sizes = {name: nbytes for _, new in items.values() for name, nbytes in new.items()}
    rows = [32, 24, 20]
    assert {k: v for k, v in sizes.items() if k.startswith("w_full")} == {
        "w_full0": rows[0] * n * 32 + rows[0] * 32, "w_full1": rows[1] * n * 64 + rows[1] * 64,
        "w_full2": rows[2] * n * 16 + rows[2] * 16}
    assert [moved for moved, _ in items.values()] == [r.received_bytes_after - r.received_bytes_before
                                                      for r in fg.rows] and all(m < 0 for m, _ in items.values())
    facts = _facts(trace)
    model = memory_model(facts, [], resized=items)
    bf16 = {name: facts.lives[name].nbytes for name in ("w_full0", "w_full1", "w_full2")}
    assert bf16 == {"w_full0": 64 * 32 * 2, "w_full1": 48 * 64 * 2, "w_full2": 40 * 16 * 2}
    life = facts.lives["w_full1"]
    change = model.live_bytes() - model.live_bytes(rewritten=False)
    assert change[life.start] <= sizes["w_full1"] - bf16["w_full1"] < 0
    assert (change <= 0).all() and change[-1] == 0
    assert model.evaluate().peak_bytes < model.evaluate(rewritten=False).peak_bytes
    # moving fewer bytes and holding fewer at every step, they are taken under every policy, even lowering no peak
    budget = {"policy": "budget", "budget_bytes": 1 << 40, "optimizer_states": 0}
    for options in ({"policy": "all"}, {"policy": "peak"}, budget):
        assert set(choose([], model, ShardOptions(**options), n).resized) == set(items) == {r.weight for r in fg.rows}
    # a weight left out by the choice keeps its bf16 gather, and the plan says why
    one = fg.chosen({fg.rows[0].weight})
    assert [r.fp8 for r in one.rows] == [True, False, False] and one.rows[1].reason == fp8_gather.NOT_CHOSEN
    assert one.rows[1].received_bytes_after == one.rows[1].received_bytes_before
    assert "1 TE linear weight(s) all-gathered in FP8" in str(one.apply(trace).get_provenance())
    # a weight left in bf16 (here every one: the option off) keeps its size
    off = fp8_gather.plan(_facts(trace), enabled=False, setup_name="Thunder FSDP (ZeRO-3)", group=GROUP, world_size=n)
    assert off.resized() == {} and memory_model(facts, [], resized={}).rewritten == ()


def test_a_te_linear_recomputed_in_the_backward_is_counted_at_its_fp8_bytes():
    """Under activation checkpointing the backward runs a block's TE linear forward again: its quantized input and
    weight occupy 1 byte an element there as in the forward (their proxies print bf16). Counted at bf16's 2, they put
    the checkpointed FP8 plans' predicted peaks over the device's (benchmarks/results/h200_2026-12-04/NOTES.md)."""
    from thunder_fp8shard.analysis.program import program_facts

    trace, _ = forward([(64, 32)])
    bw = from_trace(trace)  # the forward's names taken, as in Thunder's backward
    bw.bound_symbols = []
    with tracectx(bw):
        x, w = _t("x_again", (4, 32)), _t("w_again", (64, 32))
        bw.args = (x, w)
        r = _sym["recipe"]()
        qs = _quantizers[0](_states[0](r, "forward", 2), 2)
        y, qa, qw = _sym["linear"](x, w, None, qs[0], qs[1])
        y, qa, qw = _sym["update"](r, states=(), tokens=(y, qa, qw))
        prims.python_return(_sym["use"](qa), _sym["use"](qw), y)
    facts = program_facts(trace, bw, set())
    assert {qa.name, qw.name} <= facts.te_names and y.name not in facts.te_names
    assert (facts.nbytes(qa), facts.nbytes(qw), facts.nbytes(y)) == (4 * 32, 64 * 32, 4 * 64 * 2)
    assert facts.life_of[qw.name].nbytes == 64 * 32  # its storage, as the memory model sums it


def test_simulated_n8_llama_shapes_forward_gather_bytes():
    """The plan's bytes at N=8 for one Llama-2-7b layer's TE weights (qkv, proj, fc_1, fc_2, mlp proj): received
    bytes halve, the cast falls to 1/8."""
    layer = [(3 * 4096, 4096), (4096, 4096), (11008, 4096), (11008, 4096), (4096, 11008)]
    trace, _ = forward(layer, n=8, batch=1)
    sites = _sites(trace, n=8)
    assert all(s.why is None for s in sites)
    rows = fp8_gather.decisions(sites, 8)
    numel = 3 * 4096 ** 2 + 4096 ** 2 + 3 * 11008 * 4096
    assert sum(r.received_bytes_before for r in rows) == numel * 2 * 7 // 8
    assert sum(r.received_bytes_after for r in rows) == numel * 7 // 8
    assert sum(r.cast_elements_after for r in rows) == numel // 8


def test_a_real_fsdp_trace_without_te_is_left_alone(fsdp_traces):
    fw, bw, group = fsdp_traces
    assert fp8_gather.find_sites(_facts(fw, bw), group=group, world_size=2, default_world_size=2,
                                 recipe_problem=None) == []
    fg = fp8_gather.plan(_facts(fw, bw), enabled=True, setup_name="Thunder FSDP (ZeRO-3)", group=group, world_size=2,
                         default_world_size=2, rank=0)
    assert fg.sites == () and fg.apply(fw) is fw


@pytest.mark.multirank
def test_option_on_without_te_trains_exactly_and_says_why(on_ranks):
    """The whole pass with ``fp8_forward_gather=True`` on the CPU (the toy Llama under ZeRO-3, two gloo ranks,
    different data per rank, no TransformerEngine): nothing to gather in FP8, the plan says so, the fingerprint
    still agrees across ranks, and losses and gradients stay bitwise those of the run without the pass."""
    from thunder_fp8shard.testing import litgpt_run

    toy = dict(model="toy", n_layer=1, n_embd=64, n_head=4, intermediate_size=96, vocab_size=128, seq_len=16,
               micro_batch_size=2, steps=2, te=False, device="cpu", return_grads=True)
    without = on_ranks(litgpt_run.run_rank, 2, litgpt_run.RunConfig(**toy, shard=False))
    with_ = on_ranks(litgpt_run.run_rank, 2, litgpt_run.RunConfig(**toy, shard=True,
                                                                  extra={"min_bytes": 0, "fp8_forward_gather": True}))
    litgpt_run.assert_bitwise_equal_and_nonzero(without, with_, toy["steps"])
    plan = with_[0]["plan"]
    assert plan["forward_gather"] == [] and not any("fp8_forward_gather" in n for n in plan["notes"]), plan["notes"]


_run_ex = OperatorExecutor("fp8shard_test_runnable_te")
_run_syms = {
    "recipe": _run_ex.register_operator("get_te_fp8_recipe_90", meta=lambda: AnyProxy(None, prefix="r"),
                                        fn=lambda: None),  # no recipe: the start operator falls back to bf16
    "state": _run_ex.register_operator("get_te_fp8_state_90", meta=lambda r, mode, n: AnyProxy(None, prefix="s"),
                                       fn=lambda r, mode, n: "state"),
    "quantizers": _run_ex.register_operator(
        "get_te_fp8_quantizers_90", meta=lambda s, n: tuple(AnyProxy(None, prefix="q") for _ in range(n)),
        fn=lambda s, n: ("q_in", "q_w")),
    "linear": _run_ex.register_operator("te_functional_linear_fwd", meta=_linear_meta,
                                        fn=lambda a, w, bias, qi, qw: (a @ w.t(), a, w)),
    "update": _run_ex.register_operator("te_fp8_amax_and_scale_update",
                                        meta=lambda r, *, states, tokens: tuple(_t(None, t.shape) for t in tokens),
                                        fn=lambda r, *, states, tokens: tokens),
}


def test_rewritten_trace_runs_with_the_bf16_fallback(single_rank_group):
    """A forward with Thunder's real all-gathers and waits (one gloo rank), sorted as ``sort_waits`` sorts them (the
    all-gathers at the top, then the getters), feeding two stand-in TE linears, rewritten and run as Thunder runs it
    (its Python program): the operators print and execute, the specs travel as constants, the batched start's
    handles reach the fused linears, which call the stand-in linear's own implementation; with no FP8 recipe the
    start's bf16 fallback gives the same result as the program before the rewrite."""
    import dataclasses

    import torch
    from thunder.executors.torchex import all_gather_prim_impl, wait_prim_impl

    def computation(x, t_w0, t_w1):
        pass

    trace = TraceCtx(computation)
    with tracectx(trace):
        x = _t("x", (3, 8), dtypes.float32)
        shards = _t("t_w0", (5, 8), dtypes.float32), _t("t_w1", (4, 5), dtypes.float32)
        trace.args = (x, *shards)
        futs = [all_gather_prim_impl(t, single_rank_group, True, None) for t in shards]
        r = _run_syms["recipe"]()
        h, saved = x, []
        for fut in futs:
            s = _run_syms["state"](r, "forward", 2)
            q_in, q_w = _run_syms["quantizers"](s, 2)
            w = wait_prim_impl(fut)
            y, qa, qw = _run_syms["linear"](h, w, None, q_in, q_w)
            h, qa, qw = _run_syms["update"](r, states=(s,), tokens=(y, qa, qw))
            saved += [qa, qw]
        prims.python_return(h, (tuple(saved), (r,)))
    sites = fp8_gather.find_sites(_facts(trace), group=single_rank_group, world_size=1, default_world_size=1,
                                  recipe_problem=None)
    assert [s.why[:8] for s in sites] == ["one rank"] * 2
    new = fp8_gather.rewrite(trace, [dataclasses.replace(s, why=None) for s in sites], group=single_rank_group,
                             world_size=1, rank=0, provenance="test")
    names = _names(new)
    assert not THUNDER_CALLS & set(names), names
    assert names.count("fp8shard_weight_gather_starts") == 1 and names.count("fp8shard_te_linear_fwd") == 2, names
    xs, ws = torch.randn(3, 8), (torch.randn(5, 8), torch.randn(4, 5))
    want = trace.python_callable()(xs, *ws)
    got = new.python_callable()(xs, *ws)
    assert torch.equal(got[0], want[0]) and torch.equal(got[0], xs @ ws[0].t() @ ws[1].t()), str(new)


def test_the_ranks_fingerprint_covers_the_forward_gather_decisions():
    """A weight gathered in FP8 on one rank and in bf16 on another would hang the forward: the collectives the ranks
    compare before the rewrite (thunder_fp8shard.distributed.agreement) include each row's shape and choice."""
    from thunder_fp8shard.distributed.agreement import collectives
    from thunder_fp8shard.plan import ForwardGather

    def plan(fp8):
        return ShardPlan.of(world_size=2, method="slice", policy="all", prefetch=1, decisions=[], saved_bytes_before=0,
                         saved_bytes_after=0, forward_gather=[ForwardGather("t_w0", (64, 32), fp8, "", 2048, 1024,
                                                                            2048, 1024)])

    assert collectives(plan(True), verify=False) != collectives(plan(False), verify=False)
    assert ("forward gather 0", "64x32 fp8") in collectives(plan(True), verify=False)
    bare = ShardPlan.of(world_size=2, method="slice", policy="all", prefetch=1, decisions=[], saved_bytes_before=0,
                     saved_bytes_after=0)
    assert not any(k.startswith("forward gather") for k, _ in collectives(bare, verify=False))  # option off: as before
