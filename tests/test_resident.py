"""The memory the step runs in besides the program (thunder_fp8shard.memory.resident): one test per term on the hand-made
traces of test_liveness, whose lives are known (12 steps: forward 0-4, backward 5-11), and the whole model."""

from __future__ import annotations

import pytest
from thunder.core import devices, dtypes, prims
from thunder.core.proxies import TensorProxy
from thunder.core.trace import TraceCtx, from_trace, tracectx
from thunder.executors.sdpaex import sdpea_bwd

from test_liveness import HAND_LIVE, _hand_traces
from thunder_fp8shard.memory.device import DeviceMemory, measure
from thunder_fp8shard.analysis.program import program_facts
from thunder_fp8shard.memory.model import memory_model
from thunder_fp8shard.options import ShardOptions
from thunder_fp8shard.plan import GIVEN, MEASURED, MODELLED, NOT_COUNTED, UNKNOWN, MemoryTerm, ShardPlan
from thunder_fp8shard.memory.resident import resident_at_call, step_terms, term_lives
from thunder_fp8shard.reporting.plan_text import plan_text

LAST = 11


def _terms(options=ShardOptions(), device=None, traces=None):
    fw, bw, _ = traces or _hand_traces()
    return {t.name: t for t in step_terms(program_facts(fw, bw, set()), options, device)}


def _proxy(name, shape, device="cpu"):
    return TensorProxy(name, shape=shape, dtype=dtypes.float32, device=devices.to_device(device), requires_grad=False)


def test_resident_at_the_call_is_measured_less_the_programs_inputs_on_that_device():
    with tracectx(TraceCtx()):  # only x is on cuda:0
        inputs = [_proxy("x", (4, 4), "cuda:0"), _proxy("w", (4, 4), "cuda:1"), _proxy("b", (4,))]
    t = resident_at_call(inputs, DeviceMemory("cuda:0", 1000, ()), None, LAST)
    assert (t.source, t.spans, t.nbytes) == (MEASURED, ((0, LAST, 1000 - 64),), 936)
    assert _terms(device=DeviceMemory("cuda:0", 1000, ()))["resident at the call"].nbytes == 1000  # inputs on the CPU


def test_resident_at_the_call_given_replaces_the_measurement_and_is_not_counted_on_the_cpu():
    given = _terms(ShardOptions(resident_bytes=500), DeviceMemory("cuda:0", 1000, ()))["resident at the call"]
    assert (given.source, given.spans) == (GIVEN, ((0, LAST, 500),))
    cpu = _terms()["resident at the call"]
    assert (cpu.source, cpu.spans, cpu.nbytes) == (NOT_COUNTED, (), 0)


def test_inputs_held_by_the_caller_after_their_last_use_to_the_end_of_the_backward():
    t = _terms()["inputs held by the caller"]
    # x: program life [0, 4]; w (with its view s): [0, 8]
    assert (t.source, t.spans, t.nbytes) == (MODELLED, ((5, LAST, 64), (9, LAST, 64)), 128)


def test_outputs_held_by_the_caller_from_the_end_of_the_forward():
    t = _terms()["outputs held by the caller"]
    assert (t.source, t.spans) == (MODELLED, ((5, LAST, 64),))  # c: program life [2, 4]


def test_loss_at_the_first_backward_step_by_rule_or_given():
    assert _terms()["loss"].spans == ((5, 5, 2 * 64),)  # two copies of the 64-byte f32 output
    given = _terms(ShardOptions(loss_bytes=1000))["loss"]
    assert (given.source, given.spans) == (GIVEN, ((5, 5, 1000),))


def test_optimizer_state_is_states_times_the_returned_gradients():
    t = _terms(ShardOptions(optimizer_states=2))["optimizer state"]
    assert (t.source, t.spans) == (MODELLED, ((0, LAST, 2 * 128),))  # gw: 128 B
    none = _terms(ShardOptions(optimizer_states=0))["optimizer state"]
    assert (none.source, none.spans, none.nbytes) == (GIVEN, (), 0)


def test_optimizer_state_by_default_is_unknown_and_says_what_adamw_would_add():
    t = _terms()["optimizer state"]
    assert (t.source, t.spans, t.nbytes) == (UNKNOWN, (), 0)  # left out of the peak, not counted as 0 silently
    assert "pass optimizer_states" in t.how and "AdamW: 2, which would add 2 x the gradients" in t.how
    assert "= 256 B" in t.how  # gw: 128 B


def test_persistent_workspaces_are_what_the_device_gained_when_forced():
    assert _terms()["persistent workspaces"].source == NOT_COUNTED
    t = _terms(device=DeviceMemory("cuda:0", 0, (("cuBLAS", 1000), ("TransformerEngine GEMM", 24))))
    assert "TransformerEngine GEMM workspace" not in t
    t = t["persistent workspaces"]
    assert (t.source, t.spans) == (MEASURED, ((0, LAST, 1024),))
    assert "cuBLAS 1,000 B" in t.how


def test_a_workspace_that_could_not_be_forced_is_unknown_not_zero():
    device = DeviceMemory("cuda:0", 0, (("cuBLAS", 1000),), (("TransformerEngine GEMM", "ImportError: no API"),))
    terms = _terms(device=device)
    measured, te = terms["persistent workspaces"], terms["TransformerEngine GEMM workspace"]
    assert (measured.source, measured.nbytes) == (MEASURED, 1000) and "TransformerEngine" not in measured.how
    assert (te.source, te.spans) == (UNKNOWN, ()) and "could not be forced at compilation (ImportError: no API)" in te.how


def test_sdpa_backward_workspace_at_its_own_step():
    fw, _, p = _hand_traces()
    bw = from_trace(fw)
    with tracectx(bw):
        g = _proxy("gout", (1, 2, 8, 4))  # 64 elements: a 256-byte fp32 accumulator
        bw.args = ([[p["b"], p["w"]], []], [g])
        q, k, v, out, lse = (_proxy(n, (1, 2, 8, 4)) for n in ("q", "k", "v", "o", "lse"))
        grads = tuple(_proxy(n, (1, 2, 8, 4)) for n in ("gq", "gk", "gv"))
        bw.bound_symbols.append(sdpea_bwd.bind(g, q, k, v, None, out, lse, None, None, 0.0, True, output=grads))
        prims.python_return(grads)
    t = _terms(traces=(fw, bw, None))["kernel workspaces"]
    assert (t.source, t.spans) == (MODELLED, ((5, 5, 256),))  # the backward's first step


def test_the_device_model_is_the_program_plus_every_term_and_budgets_see_it():
    fw, bw, _ = _hand_traces()
    model = memory_model(program_facts(fw, bw, set()), [], options=ShardOptions())
    assert model.evaluate([], terms=False).live_bytes == HAND_LIVE
    # + loss 128 at 5; + x, c held 64 each from 5; + w held 64 from 9
    assert model.evaluate([]).live_bytes == (192, 192, 256, 256, 256, 640, 320, 320, 448, 320, 320, 320)
    device = DeviceMemory("cuda:0", 100, (("cuBLAS", 24),))  # no input on cuda:0: all 100 B are resident
    model = memory_model(program_facts(fw, bw, set()), [], options=ShardOptions(optimizer_states=2), device=device)
    after = model.evaluate([])
    assert after.peak_bytes == 640 + 100 + 24 + 256 and after.peak_step.index == 5


def test_term_lives_one_per_span_and_none_for_empty_terms():
    terms = [MemoryTerm("a", MODELLED, "", ((0, 3, 10), (2, 3, 5))), MemoryTerm("b", NOT_COUNTED, "")]
    lives = term_lives(terms)
    assert [(v.start, v.end, v.nbytes) for v in lives.values()] == [(0, 3, 10), (2, 3, 5)]
    assert terms[0].nbytes == 15 and terms[0].where(4) == "every step" and terms[1].where(4) == "-"


def _plan(model):
    before = model.evaluate([])
    return ShardPlan.of(2, "slice", "all", 1, [], 0, 0, peak_bytes_before=before.peak_bytes,
                     peak_bytes_after=before.peak_bytes, program_peak_bytes_before=384, program_peak_bytes_after=384,
                     terms=list(model.terms), timeline_before=before, timeline_after=before)


def test_plan_says_which_terms_were_measured_modelled_or_given():
    fw, bw, _ = _hand_traces()
    model = memory_model(program_facts(fw, bw, set()), [], options=ShardOptions(resident_bytes=7, optimizer_states=2),
                         device=DeviceMemory("cuda:0", 0, (("cuBLAS", 24),)))
    plan = _plan(model)
    lines = plan_text(plan).splitlines()
    row = {line.split("  ")[0]: line for line in lines}
    assert "384 -> 384" in row["jitted program (its peak)"]
    assert GIVEN in row["resident at the call"] and "every step" in row["resident at the call"]
    assert MEASURED in row["persistent workspaces"] and MODELLED in row["optimizer state"]
    assert "steps 5-5" in row["loss"]
    assert f"{plan.peak_bytes_before:,} B" in lines[-1] and "WITHOUT" not in lines[-1] and plan.left_out == []


def test_the_plans_headline_names_what_the_predicted_peak_leaves_out():
    """By default the optimizer's state is unknown (and here the TE workspace could not be forced): the peak line
    says that it leaves them out, and what Adam/AdamW would add."""
    fw, bw, _ = _hand_traces()
    device = DeviceMemory("cuda:0", 0, (("cuBLAS", 24),), (("TransformerEngine GEMM", "ImportError: gone"),))
    plan = _plan(memory_model(program_facts(fw, bw, set()), [], options=ShardOptions(), device=device))
    assert [t.name for t in plan.left_out] == ["optimizer state", "TransformerEngine GEMM workspace"]
    lines = plan_text(plan).splitlines()
    headline = next(i for i, line in enumerate(lines) if line.startswith("predicted peak per rank"))
    assert lines[headline].endswith(", WITHOUT 2 term(s) of unknown size:")
    assert lines[headline + 1].startswith("  leaves out the optimizer state: unknown: pass optimizer_states (Adam, "
                                          "AdamW: 2, which would add 2 x the gradients the backward returns = 256 B")
    assert lines[headline + 2] == ("  leaves out the TransformerEngine GEMM workspace: could not be forced at "
                                   "compilation (ImportError: gone)")
    assert UNKNOWN in {line.split("  ")[0]: line for line in lines}["optimizer state"]


@pytest.mark.parametrize("bad", [{"optimizer_states": -1}, {"optimizer_states": 1.5}, {"resident_bytes": 1.5},
                                 {"loss_bytes": -2}])
def test_new_options_are_validated(bad):
    with pytest.raises(ValueError):
        ShardOptions(**bad)


def test_nothing_is_measured_on_the_cpu():
    fw, _, _ = _hand_traces()
    assert measure(fw, transformer_engine=False) is None


def test_a_parameter_proxy_sharded_by_thunders_fsdp_counts_its_shard():
    """Thunder's FSDP transform shards a parameter's proxy by rewriting its ``_shape`` only (fsdp_v2.py), so the
    proxy's cached ``numel`` still counts the whole parameter: the model sizes tensors from their shapes."""
    from thunder.core import devices, dtypes
    from thunder.core.proxies import TensorProxy
    from thunder.core.trace import TraceCtx, tracectx

    from thunder_fp8shard.analysis.saved import numel, tensor_nbytes

    with tracectx(TraceCtx()):
        p = TensorProxy("w", shape=(64, 24), dtype=dtypes.bfloat16, device=devices.cpu, requires_grad=True)
    p._shape = (32, 24)  # what FSDPTransform does for 2 ranks
    assert numel(p) == 32 * 24 and tensor_nbytes(p) == 32 * 24 * 2
