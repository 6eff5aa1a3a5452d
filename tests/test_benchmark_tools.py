"""The benchmark tooling (not the pass): the profile summary's gap classes and the comparison's medians."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import fresh_clone  # noqa: E402
import thunder_litgpt  # noqa: E402
import time_profile  # noqa: E402
from benchlib import revisions, stats, steps  # noqa: E402


def _k(name, ts, dur, stream, corr):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream, "correlation": corr}}


def _launch(ts, corr):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 2, "args": {"correlation": corr}}


def test_time_profile_step_tells_cpu_starved_gaps_from_waits():
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "autograd::engine::evaluate_function: ThunderFunctionBackward", "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "user_annotation", "name": "fp8shard_gather_wait", "ts": 300, "dur": 40},
        # compute stream 7: gemm 0-100; a gap 100-200 ended by a kernel launched at 10 (it waited); another gap
        # 300-450 ended by a kernel launched at 440 (the CPU was late)
        _launch(1, 1), _k("gemm", 0, 100, 7, 1),
        _launch(10, 2), _k("gemm", 200, 100, 7, 2),
        _launch(440, 3), _k("gemm", 450, 50, 7, 3),
        _launch(20, 4), _k("ncclDevKernel_AllGather_RING_LL(x)", 120, 70, 9, 4),
    ]
    s = time_profile.summarize({"traceEvents": events})
    assert s["compute_stream"] == 7
    c = s["compute"]
    assert (c["kernels"], c["busy_ms"], c["idle_ms"]) == (3, 0.25, 0.25)
    assert c["gap_ms_by_kind"] == {"cpu": 0.15, "wait": 0.1}
    assert s["compute_backward"]["kernels"] == 3
    assert s["nccl_streams"]["9"]["kinds"] == {"ncclDevKernel_AllGather_RING_LL": {"count": 1, "ms": 0.07}}
    assert s["cpu_ranges"]["fp8shard_gather_wait"] == {"count": 1, "ms": 0.04}


def _run(side, t, mem):
    return {"side": side, "perf_metrics": {"average_iter_time": t, "memory_used_GB": mem},
            "plan": {"world_size": 2, "fp8_weight_bytes": 4e9, "sharded_bytes": 4e9}}


def test_comparison_takes_medians_and_merges_interleaved_halves(tmp_path):
    runs = [_run("without", 100.0, 50.0), _run("with", 103.0, 48.1), _run("without", 102.0, 50.0), _run("with", 101.0, 48.1)]
    s = thunder_litgpt.compare(runs)
    assert s["median"]["without"]["average_iter_time"] == 101.0 and s["median"]["with"]["average_iter_time"] == 102.0
    assert round(s["overhead_pct"], 6) == round(100 * (102 / 101 - 1), 6)
    assert round(s["reduction_share_of_fp8_weight_bytes"], 6) == round(1.9 / 2.0, 6)
    base = {"flags": ["--n_layers=2"], "options": {}, "world_size": 2, "device": "x"}
    paths = []
    for i, half in enumerate((runs[:2], runs[2:])):
        paths.append(str(tmp_path / f"{i}.json"))
        with open(paths[-1], "w") as f:
            json.dump(dict(base, runs=half, order=[r["side"] for r in half]), f)
    thunder_litgpt.merge(paths, str(tmp_path / "all.json"))
    with open(tmp_path / "all.json") as f:
        merged = json.load(f)
    assert merged["order"] == ["without", "with", "without", "with"] and len(merged["with"]) == 2
    assert merged["summary"] == json.loads(json.dumps(s))


def test_garbage_collections_are_charged_to_their_iterations():
    starts = [10.0, 10.5, 11.0, 11.5]  # three iterations, then the end of the last
    collections = [(9.0, 2, 0.3), (10.1, 0, 0.001), (10.6, 2, 0.25), (10.9, 1, 0.01), (11.6, 2, 1.0)]
    got = steps.gc_per_iteration(starts, collections)
    assert got["iteration_gc_ms"] == pytest.approx([1.0, 260.0, 0.0])  # before the first and after the last: none
    assert got["full_collection_iterations"] == [1]


def test_pinning_gives_each_rank_whole_physical_cores():
    # 4 cores with 2 SMT siblings each (cpu k and k + 4 share core k), as Linux numbers them
    core_of = {cpu: cpu % 4 for cpu in range(8)}
    assert thunder_litgpt.split_cores(list(range(8)), core_of, 2) == [[0, 4, 1, 5], [2, 6, 3, 7]]
    assert thunder_litgpt.split_cores([0, 1, 2, 4, 5], core_of, 2) == [[0, 4], [1, 5]]  # core 2 has one cpu: unused
    with pytest.raises(ValueError, match="2 physical cores for 3 ranks"):
        thunder_litgpt.split_cores([0, 4, 1], core_of, 3)


# ---- plan_accuracy.py: the measured and predicted timelines of one step ------------------------------------------------

import linecache  # noqa: E402

import plan_accuracy as acc  # noqa: E402

from thunder_fp8shard.analysis.liveness import Life, Step, timeline  # noqa: E402
from thunder_fp8shard.plan import MODELLED, MemoryTerm, ShardPlan  # noqa: E402


def _alloc(size, addr, frames=()):
    return {"action": "alloc", "size": size, "addr": addr, "frames": list(frames)}


def _free(size, addr):
    return {"action": "free", "size": size, "addr": addr, "frames": []}


def _marker(addr=999):
    return [_alloc(acc.MARK_BYTES, addr), _free(acc.MARK_BYTES, addr)]


def _step_events(frames=()):
    """forward: +100, +50 (the peak, 1150 with the 1000 baseline); loss: -50; backward: +30, -100; optimizer: -30."""
    return [*_marker(), _alloc(100, 1), _alloc(50, 2, frames), *_marker(), _free(50, 2), *_marker(5),
            _alloc(30, 3), _free(100, 1), *_marker(), _free(30, 3), *_marker()]


def test_measured_timeline_from_marked_events():
    m = acc.measured_timeline(_step_events(), baseline=1000)
    assert m["bytes"] == [1100, 1150, 1100, 1130, 1030, 1000]
    assert m["phase"] == ["forward", "forward", "loss", "backward", "backward", "optimizer"]
    assert m["x"] == [0.5, 1.0, 1.15, 1.15 + 0.5, 2.15, 2.3]
    assert (m["peak"]["bytes"], m["peak"]["phase"], m["peak"]["event"], m["peak"]["size"]) == (1150, "forward", 1, 50)
    try:
        acc.measured_timeline(_step_events()[2:], 0)
    except ValueError as e:
        assert "expected 5 phase markers" in str(e)
    else:
        raise AssertionError("a missing marker must be reported")


def test_events_from_the_cuda_snapshot_and_the_cpu_profiler():
    snapshot = {"device_traces": [[], [
        {"action": "segment_alloc", "addr": 0, "size": 2 << 20}, {"action": "alloc", "addr": 8, "size": 512, "frames": []},
        {"action": "free_requested", "addr": 8, "size": 512}, {"action": "free_completed", "addr": 8, "size": 512}]]}
    assert [(e["action"], e["size"]) for e in acc.events_from_snapshot(snapshot, 1)] == [("alloc", 512), ("free", 512)]
    mem = lambda ts, b, addr, dev=0: {"name": "[memory]", "ts": ts, "args": {"Bytes": b, "Addr": addr, "Device Type": dev}}  # noqa: E731
    trace = {"traceEvents": [mem(2, -64, 1), mem(1, 64, 1), mem(3, 32, 2, dev=1), {"name": "aten::mm", "ts": 0}]}
    assert [(e["action"], e["size"]) for e in acc.events_from_profiler_trace(trace)] == [("alloc", 64), ("free", 64)]


def _hand_plan():
    """4 forward steps, 4 backward; a 10-byte term over every step (the device model is the program + 10)."""
    steps = tuple(Step(i, "forward" if i < 4 else "backward", f"t{i} = torch.op{i}") for i in range(8))
    lives = {"a": Life("a", ("a",), 100, 0, 5), "b": Life("b", ("b",), 40, 2, 3)}
    term = MemoryTerm("resident at the call", MODELLED, "", ((0, 7, 10),))
    t = timeline({**lives, "term": Life("term", (), 10, 0, 7)}, steps)
    return ShardPlan.of(2, "slice", "all", 1, [], 0, 0, peak_bytes_before=t.peak_bytes, peak_bytes_after=t.peak_bytes,
                     program_peak_bytes_before=140, program_peak_bytes_after=140, terms=[term], timeline_before=t,
                     timeline_after=t)


def test_predicted_timeline_lines_up_with_the_phases():
    p = acc.predicted_timeline(_hand_plan())
    # forward steps at 0, .25, .5, .75; the first backward step's bytes held over the loss phase from 1.0
    assert p["x"] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.15, 1.4, 1.65, 1.9]
    assert p["bytes"] == [110, 110, 150, 150, 110, 110, 110, 10, 10]
    assert p["program_bytes"] == [b - 10 for b in p["bytes"]]
    assert p["peak"] == {"bytes": 150, "phase": "forward", "step": 2, "label": "t2 = torch.op2", "x": 0.5,
                         "program_peak_bytes": 140}


def test_report_maps_the_measured_peak_to_thunders_line_and_the_plans_step(tmp_path):
    program = "thunder.backward_fn_0"  # a generated program, as Thunder registers it in linecache
    linecache.cache[program] = (0, None, ["def backward_fn(x):\n", "  t2 = torch.op2(x)\n"], program)
    frames = [{"filename": "torch/nn/functional.py", "line": 1, "name": "linear"},
              {"filename": program, "line": 2, "name": "backward_fn"}]
    r = acc.report(_hand_plan(), _step_events(frames), 1000, {"max_memory_allocated": 1150, "max_requested_bytes": 1150})
    peak = r["measured"]["peak"]
    assert peak["thunder_line"] == {"program": program, "line": 2, "text": "t2 = torch.op2(x)"}
    assert peak["plan_step"] == {"step": 2, "phase": "forward", "label": "t2 = torch.op2"}
    assert peak["frames"][0] == "torch/nn/functional.py:1 linear"
    assert r["measured"]["max_bytes_by_phase"] == {"forward": 1150, "loss": 1100, "backward": 1130, "optimizer": 1000}
    assert (r["predicted"]["peak_bytes"], r["error_bytes"]) == (150, 150 - 1150)
    result = {"config": {"world_size": 2, "model": "toy", "model_name": "", "n_layer": 1, "seq_len": 8, "te": False,
                         "backend": "gloo"}, "ranks": [r]}
    acc.write(result, str(tmp_path / "acc.json"))
    assert json.load(open(tmp_path / "acc.json"))["ranks"][0]["measured"]["rebuilt_max_bytes"] == 1150
    assert (tmp_path / "acc.png").read_bytes()[:4] == b"\x89PNG"
    labels = {line.get_label() for line in acc.plot_accuracy(r).axes[0].get_lines()}
    assert {"measured", "predicted (device model)", "predicted (program alone)", "peak measured", "peak predicted"} <= labels


def test_downsample_keeps_the_maximum_of_every_bin():
    x, y = acc.downsample(list(range(10)), [0, 5, 1, 1, 9, 2, 0, 0, 3, 0], n=3)
    assert (x, y) == ([1, 4, 8], [5, 9, 3])


# ---- the paired benchmark (benchmarks/paired.py; benchlib.stats): its schedule and statistics ------------------------

import numpy as np  # noqa: E402

import paired  # noqa: E402


def test_paired_schedule_is_abba_quads_against_the_base_for_each_arm():
    s = stats.quad_schedule(3, 2)
    assert [arm for _, _, arm in s] == [0, 1, 1, 0, 0, 2, 2, 0] * 2
    assert [q for q, _, _ in s] == [q for q in range(4) for _ in range(4)]
    # within each arm's quads, it runs once after itself and once after the other side, as the base does
    seq = [arm for _, _, arm in s]
    after_self = {k: sum(1 for a, b in zip(seq, seq[1:]) if b == k and a == k) for k in (1, 2)}
    assert after_self == {1: 2, 2: 2}


def _records(wall_of, n_arms=2, quads=60, drift=0.0, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i, (q, pos, arm) in enumerate(stats.quad_schedule(n_arms, quads)):
        base = 100.0 * (1 + drift * np.sin(i / 25.0))  # the machine's speed wanders, within a quad too
        w = base * wall_of[arm] + rng.normal(0, 0.3)
        out.append({"quad": q, "position": pos, "arm": arm, "wall_ms": w, "cpu_ms": 0.8 * w, "issue_ms": 0.6 * w,
                    "cpu_issue_ms": 0.6 * w, "peak_bytes": 10e9 - (1e9 if arm == 1 else 0), "device_allocs": 0,
                    "alloc_retries": 0})
    return out


def test_paired_overhead_finds_a_planted_one_percent_under_drift_and_the_null_contains_zero():
    # 10% drift of the machine's speed (the "two speeds" seen on the H200): the pairing cancels it
    records = _records({0: 1.0, 1: 1.01, 2: 1.0}, n_arms=3, drift=0.10)
    treated, null = stats.compare(records, 1), stats.compare(records, 2)
    lo, hi = treated["overhead_pct"]["ci95"]
    assert lo < 1.0 < hi and hi - lo < 0.5
    lo, hi = null["overhead_pct"]["ci95"]
    assert lo < 0.0 < hi and hi - lo < 0.5
    assert treated["memory_reduction_GB"] == pytest.approx(1.0) and null["memory_reduction_GB"] == 0
    assert treated["overhead_pct"]["pairs"] == 120  # 60 quads, two pairs each


def test_paired_differences_pair_each_iteration_with_the_base_beside_it():
    records = [{"quad": 0, "position": p, "arm": a, "wall_ms": w}
               for p, (a, w) in enumerate([(0, 10.0), (1, 12.0), (1, 13.0), (0, 11.0)])]
    quads, diffs, base = stats.paired_differences(records, 1, "wall_ms")
    assert quads.tolist() == [0] and diffs.tolist() == [[2.0, 2.0]] and base.tolist() == [[10.0, 11.0]]
    assert stats.paired_differences(records, 2, "wall_ms")[1].size == 0  # arm 2 has no quads here


def test_another_revision_of_the_pass_imports_beside_this_one(tmp_path):
    """An arm of the paired benchmark may run another revision of the pass in the same process: the other one's
    package, operators and executor come under other names."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    from thunder_fp8shard import ShardIntermediates
    from thunder_fp8shard.runtime import ops

    other = revisions.import_revision("HEAD", str(tmp_path))
    assert other.__name__ == "thunder_fp8shard_rev" and other.ShardIntermediates is not ShardIntermediates
    import importlib

    other_ops = importlib.import_module("thunder_fp8shard_rev.runtime.ops")
    assert other_ops.executor.name != ops.executor.name and other_ops.shard.name != ops.shard.name
    assert other_ops.payload.__name__ == "thunder_fp8shard_rev.runtime.payload"


@pytest.mark.parametrize("argv, error", [
    (["--comm-stream"], "--comm-stream is for simulated ranks on CUDA"),
    (["--comm-stream", "--simulate", "2", "--device", "cpu"], "--comm-stream is for simulated ranks on CUDA"),
    (["--comm-stream", "--simulate", "2", "--arms", '{"without": null, "old": {"revision": "HEAD"}}'],
     "patches this checkout's operators only"),
])
def test_paired_refuses_a_comm_stream_it_cannot_apply_to_every_arm(argv, error, capsys):
    """--comm-stream patches this checkout's gathers over the fake group; NCCL keeps its own stream, the CPU has none,
    and another revision's operators are not patched."""
    with pytest.raises(SystemExit):
        paired.main(argv)
    assert error in capsys.readouterr().err


def test_a_relative_budget_is_the_base_step_peak_over_what_is_resident_now_less_the_margin():
    # the base peaked at 50 over the 4 resident when it was built; 30 are resident now: this arm's step would peak
    # at 76 without the pass, so 3 under it is 73
    assert paired.relative_budget(30, 50, 4, 3) == 73
    with pytest.raises(ValueError, match="budget_below_base_bytes must be >= 0"):
        paired.relative_budget(30, 50, 4, -1)


def test_every_result_file_is_in_the_readmes_index():
    """The results index (benchmarks/results/README.md, its section "## Files") names every file under
    benchmarks/results/ but that README itself (in its first column, ``{a,b}`` expanding), and names no file that is
    not there."""
    import itertools
    import re

    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    text = open(os.path.join(bench, "results", "README.md")).read()
    index = text[text.index("\n## Files\n"):]
    index = index[: index.index("\n## ", 5)] if "\n## " in index[5:] else index
    named = set()
    for row in index.splitlines():
        if row.startswith("| `"):
            for token in re.findall(r"`([^`]+)`", row.split("|")[1]):
                parts = re.split(r"\{([^}]*)\}", token)
                named.update("".join(c) for c in itertools.product(*[p.split(",") if i % 2 else [p]
                                                                     for i, p in enumerate(parts)]))
    present = {os.path.relpath(os.path.join(d, f), os.path.join(bench, "results"))
               for d, _, files in os.walk(os.path.join(bench, "results")) for f in files} - {"README.md"}
    assert present - named == set(), "result files the index does not name"
    assert named - present == set(), "the index names files that do not exist"


def test_plan_accuracy_reports_leave_out_plans_that_see_one_subgraph():
    """Under ThunderFX (FSDP2) each plan sees one subgraph, and its predicted peak is not the step's: no accuracy
    report compares it with the step's device peak (the H200 run of 2026-12-02 would have read -58%)."""
    from benchlib.reporting import accuracy_reports

    def result(integration):
        plan = {"integration": integration, "peak_bytes_after": 90, "peak_bytes_before": 100, "terms": [],
                "audit": None, "calibration": None}
        return {"arm": "with", "base": "without", "options": {}, "null": False, "predicted_peak_GB": {},
                "measured_peak_GB": {"base": 1e-7, "arm": 0.9e-7}, "arms": [{"name": "with", "plan": plan}],
                "device": "d", "simulated": True, "world_size": 8, "n_layers": 8, "low_precision_mode": "fp8",
                "flags": ["--compile=thunder_inductor_cat"], "started": "t", "launch": "l"}

    zero3 = accuracy_reports([result("Thunder FSDP (ZeRO-3)")])
    assert sorted(zero3) == ["with", "without"] and zero3["with"]["error_pct"] == 0.0
    assert zero3["with"]["checkpoint_activations"] is False
    checkpointed = result("Thunder FSDP (ZeRO-3)")
    checkpointed["flags"] = [*checkpointed["flags"], "--checkpoint_activations=True"]
    assert accuracy_reports([checkpointed])["with"]["checkpoint_activations"] is True
    assert accuracy_reports([result("FSDP2 (fully_shard) under ThunderFX")]) == {}
    # an arm with a model of its own (paired.py's "flags", as Thunder's benchmark spells them): its report has its
    # flags, and no report of the base's peak from its plan, which is of another model (s34: "+27%", of nothing)
    own = result("Thunder FSDP (ZeRO-3)")
    own["arms"][0]["flags"] = ["--compile=thunder_inductor_cat", "--checkpoint_activations=true"]
    reports = accuracy_reports([own])
    assert sorted(reports) == ["with"] and reports["with"]["checkpoint_activations"] is True


def test_the_plan_summary_leaves_out_a_plan_replanned_after_a_missed_budget():
    """After a missed budget the pass drops the compiled program and plans again: only the new plan runs, so the
    totals (bytes sharded and gathered a step) are its own (on the H200, 2026-12-02, the 8-layer budget arms' JSONs
    summed both plans)."""
    import types

    from benchlib.reporting import plan_summary
    from thunder_fp8shard.plan import Decision, ShardPlan
    from thunder_fp8shard.runtime.run_report import CalibrationReading, RunReport

    def plan(sharded_bytes):
        d = Decision(name="t", shape=(4,), dtype="float8_e4m3fn", kind="float8", nbytes=sharded_bytes, replicated=True,
                     sharded=True, reason="identical on every rank", shard_nbytes=sharded_bytes // 8)
        return ShardPlan.of(world_size=8, method="slice", policy="budget", prefetch=1, decisions=[d], saved_bytes_before=0,
                         saved_bytes_after=0)

    def report(missed):
        return RunReport(calibration=CalibrationReading(2, 2, 1, 1, 100.0, "end of backward call 2",
                                                        budget_missed=missed), runs_per_step=1)

    s = plan_summary(types.SimpleNamespace(plans=[plan(100), plan(700)], reports=[report(True), report(False)]))
    assert (s["sharded_bytes"], s["fp8_sharded_bytes"], s["plans"], s["replanned"]) == (700, 700, 1, 1)
    assert s["calibration"]["budget_missed"] is False and s["runs_per_step"] == [1]
    assert plan_summary(types.SimpleNamespace(plans=[plan(100)], reports=[report(False)]))["replanned"] == 0


def test_fingerprints_compare_plans_and_traces_up_to_names_and_quoted_source():
    import plan_fingerprints as fp

    trace = "def computation(t_a_weight, x):\n  # toy_models.py:29: x * 2\n  t5 = mul(x, t_a_weight)  # t5: f32[2]\n  return t5"
    renamed = "def computation(weight, x):\n  # toy_models.py:31: torch.mul(x, 2)\n  t8 = mul(x, weight)  # t8: f32[2]\n  return t8"
    plans = lambda n: [{"decisions": [{"name": n, "nbytes": 4}]}]  # noqa: E731
    before = {"c": {"traces": [trace], "plans": plans("t5")}}
    assert fp.same_behaviour(before, {"c": {"traces": [renamed], "plans": plans("t8")}}) == []
    assert fp.same_behaviour(before, {"c": {"traces": [renamed.replace("mul", "add")], "plans": plans("t8")}}) == ["c"]
    assert fp.same_behaviour(before, {"c": {"traces": [renamed], "plans": [{"decisions": [{"name": "t8", "nbytes": 5}]}]}}) == ["c"]


def test_one_model_arms_keep_the_cache_their_programs_leave_and_are_remade_after_a_drop(monkeypatch):
    """``--one-model``: before an arm's iteration its programs become the model's cache; the arm that ran last keeps
    the cache as its programs left it (a steady-state entry swapped in stays), and an arm whose pass dropped the
    cache (a missed budget) gets its programs made again when it runs next."""
    cache: list = []
    made = []
    monkeypatch.setattr(paired.shared_compile, "entries", lambda model: list(cache))
    monkeypatch.setattr(paired.shared_compile, "activate", lambda model, es: cache.__setitem__(slice(None), es))
    monkeypatch.setattr(paired.shared_compile, "programs",
                        lambda model, base, shard: (made.append(shard) or [f"{shard}-v{len(made)}"], 0.1))
    base = paired.Arm("without", None, bench=type("B", (), {"model": object()})(), entries=["base"])
    arm = paired.Arm("with", {}, bench=base.bench, shard="with")
    paired._make_programs(base, arm)
    assert not paired._activate(base, arm) and cache == ["with-v1"]
    cache[:] = ["with-steady"]  # the pass swapped its entry for the steady-state one
    assert not paired._activate(base, base) and cache == ["base"] and arm.entries == ["with-steady"]
    assert not paired._activate(base, arm) and cache == ["with-steady"]
    cache.clear()  # its pass dropped the cache: replans at the next call
    assert not paired._activate(base, base) and arm.entries is None and cache == ["base"]
    assert paired._activate(base, arm) and cache == ["with-v2"] and arm.replans == 1


def test_call_cost_ops_makes_the_operators_of_this_version_and_times_each():
    """It builds the pass's run-time objects itself, so it breaks when their signatures change (it did once)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "call_cost.py"), "ops", "--repeat", "20"],
                         capture_output=True, text=True, check=True, cwd=root)
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(rows) >= {"fp8shard_compact, 1 view", "fp8shard_compact, 4 views", "fp8shard_audit, done",
                         "fp8shard_calibrate, done"}


# ---- what the memory buys (benchmarks/capacity.py): the search's rules and the rows ------------------------------------

import capacity  # noqa: E402

GB = 10**9


def _record(name, predicted, runs=(), status="done"):
    """A configuration's record: its predicted peaks (side -> GB) and runs ((side, cap, fits, tokens/s, peak GB))."""
    return {"config": name, "status": status, "predicted_peak_bytes": {s: p * GB for s, p in predicted.items()},
            "runs": [{"side": s, "cap_gb": c, "fits": f, "tokens_per_s": t, "peak_bytes": pk * GB, "steps": 12}
                     for s, c, f, t, pk in runs]}


def test_a_side_runs_only_under_the_caps_its_prediction_fits_and_a_larger_micro_batch_only_after_a_smaller_fits():
    assert capacity.caps_to_try(46.2 * GB, (40, 48, 80)) == [48, 80]
    assert capacity.caps_to_try(80.6 * GB, (40, 48, 80)) == [] and capacity.caps_to_try(None, (48, 40)) == [40, 48]
    c = capacity.Config.parse("fp8_s8192_mb4_full")
    assert (c.setup, c.micro_batch, c.checkpointing, c.seq, c.name) == ("fp8_s8192", 4, False, 8192, "fp8_s8192_mb4_full")
    assert "--micro_batch_size=4" in c.flags(32) and "--checkpoint_activations=false" in c.flags(32)
    assert c.tokens_per_step(8) == 4 * 8192 * 8
    mbs, caps = (1, 2, 4), (40, 48, 80)
    assert capacity.compile_it(capacity.Config("fp8_s4096", 1, False), {}, mbs, caps) is True
    assert capacity.compile_it(c, {}, mbs, caps) is None  # micro-batch 2's prediction not known yet
    over = {"fp8_s8192_mb2_full": _record("fp8_s8192_mb2_full", {"with": 130, "without": 140})}
    assert capacity.compile_it(c, over, mbs, caps) is False
    fits = {"fp8_s8192_mb2_full": _record("fp8_s8192_mb2_full", {"with": 79, "without": 140})}
    assert capacity.compile_it(c, fits, mbs, caps) is True
    # pruned: mb2's without side (3 caps) and its with side under 40 and 48; a skipped configuration's 2 x 3 runs
    assert capacity.pruned_runs({**fits, "x": {"status": "skipped", "runs": []}}, caps) == 5 + 6


def test_an_out_of_memory_is_the_caps_where_the_device_had_the_bytes_free():
    cap = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 30.50 GiB "
           "is free. Process 1 has 48.6 GiB memory in use. 44.70 GiB allowed; Of the allocated memory ...")
    assert capacity.oom_of_the_cap(cap)
    assert not capacity.oom_of_the_cap(cap.replace("30.50 GiB is free", "512.00 MiB is free"))


def test_each_sides_winner_is_its_fastest_configuration_confirmed_under_a_cap_at_most_this_one(tmp_path):
    records = {
        "fp8_s4096_mb1_full": _record("fp8_s4096_mb1_full", {"with": 38.4, "without": 46.2}, [
            ("with", 40, True, 90_000, 38.4), ("without", 48, True, 91_000, 46.2)]),
        "fp8_s4096_mb4_ckpt": _record("fp8_s4096_mb4_ckpt", {"with": 12, "without": 20}, [
            ("with", 40, True, 80_000, 12.0), ("without", 40, False, None, 39.9), ("without", 48, True, 79_000, 21)]),
        "fp8_s4096_mb2_ckpt": _record("fp8_s4096_mb2_ckpt", {"with": 10, "without": 14}, [
            ("with", 40, True, 70_000, 10.0), ("without", 40, True, 69_000, 14.0)]),
    }
    w = capacity.winners(records, "fp8_s4096", 40)
    assert w["with"][0].name == "fp8_s4096_mb1_full" and w["without"][0].name == "fp8_s4096_mb2_ckpt"
    w = capacity.winners(records, "fp8_s4096", 48)
    assert w["with"][0].name == "fp8_s4096_mb1_full" and w["without"][0].name == "fp8_s4096_mb1_full"
    # one ranking for both sides (the mean of their runs): where both fit the same configurations, the same winner,
    # though each side's own run would rank them apart (the unpaired runs' noise exceeds the pass's cost)
    both = {"fp8_s4096_mb2_ckpt": _record("fp8_s4096_mb2_ckpt", {"with": 10, "without": 14}, [
        ("with", 40, True, 75_000, 10.0), ("without", 40, True, 70_000, 14.0)]),
        "fp8_s4096_mb4_ckpt": _record("fp8_s4096_mb4_ckpt", {"with": 12, "without": 20}, [
            ("with", 40, True, 72_000, 12.0), ("without", 40, True, 74_000, 20.0)])}
    assert capacity.speed(both["fp8_s4096_mb4_ckpt"]) == 73_000
    assert {s: w[0].name for s, w in capacity.winners(both, "fp8_s4096", 40).items()} == {
        "with": "fp8_s4096_mb4_ckpt", "without": "fp8_s4096_mb4_ckpt"}
    for name, r in records.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(r))
    paired_dir = tmp_path / "paired"
    paired_dir.mkdir()
    (paired_dir / "fp8_s4096_mb2_ckpt__fp8_s4096_mb1_full_with.json").write_text(json.dumps({
        "tokens_per_s": {"base": 60_000, "arm": 84_000}, "tokens_per_s_ratio": {"median": 1.4, "ci95": [1.38, 1.42]}}))
    (paired_dir / "fp8_s4096_mb2_ckpt__fp8_s4096_mb1_full_null.json").write_text(json.dumps({"overhead_pct": {"ci95": [-0.1, 0.1]}}))
    rows = capacity.rows(str(tmp_path), [str(paired_dir)], (40, 48))
    r40, r48 = rows
    assert (r40["cap_gb"], r40["with"]["micro_batch"], r40["with"]["checkpointing"]) == (40, 1, False)
    assert (r40["without"]["micro_batch"], r40["without"]["checkpointing"], r40["without"]["peak_gb"]) == (2, True, 14.0)
    assert r40["tokens_per_s_ratio"] == 1.4 and r40["ci95"] == [1.38, 1.42] and r40["null_overhead_ci95"] == [-0.1, 0.1]
    assert r40["with"]["tokens_per_s"] == 84_000 and r40["with"]["tokens_per_s_from"] == "paired"
    assert r48["same_configuration"] and r48["tokens_per_s_ratio"] is None
    cmd = capacity.paired_command(r40, 32, 8, 40)
    assert "--micro_batch_size=2" in cmd.split(" -- ")[1] and '"flags": [' in cmd and "--checkpoint_activations=true" in cmd
    assert '"with": {}' in capacity.paired_command(r48, 32, 8, 40)  # the same configuration: the pass's own cost
    assert capacity.paired_commands([r40], 32, 8, 40) == []  # timed already (its paired JSON in the folder)
    untimed = {**r40, "tokens_per_s_ratio": None}
    cmds = capacity.paired_commands([r48, untimed, untimed], 32, 8, 40)  # each pair once, two configurations first
    assert len(cmds) == 2 and '"flags"' in cmds[0] and cmds[1].endswith(capacity.Config.parse(
        "fp8_s4096_mb1_full").flags(32)[-1]) and "--out $R/paired/fp8_s4096_mb1_full__fp8_s4096_mb1_full " in cmds[1]
    # one configuration's row timed by another launch of the folder whose base runs its flags and whose arm is {}
    # (issue #62's launches: Thunder's flags, without --checkpoint_activations=false), its own null beside it
    launch = {"kind": "paired", "arm": "default", "flags": [f for f in capacity.Config.parse(
        "fp8_s4096_mb1_full").flags(32) if "checkpoint" not in f], "device": "H100", "arms": [
        {"name": "default", "options": {"optimizer_states": 0}, "revision": None, "flags": None}],  # --one-model's
        "tokens_per_s": {"base": 80_000, "arm": 79_000}, "tokens_per_s_ratio": {"median": 0.987, "ci95": [0.98, 0.99]}}
    (paired_dir / "fp8_l32_s35_default.json").write_text(json.dumps(launch))
    (paired_dir / "fp8_l32_s35_null.json").write_text(json.dumps({"overhead_pct": {"ci95": [-0.2, 0.1]}}))
    r48 = capacity.rows(str(tmp_path), [str(paired_dir)], (40, 48))[1]
    assert (r48["tokens_per_s_ratio"], r48["paired_file"], r48["null_overhead_ci95"]) == (
        0.987, "fp8_l32_s35_default.json", [-0.2, 0.1])
    launch["arms"][0]["revision"] = "again"  # another revision's pass is not the user's
    (paired_dir / "fp8_l32_s35_default.json").write_text(json.dumps(launch))
    assert capacity.rows(str(tmp_path), [str(paired_dir)], (40, 48))[1]["tokens_per_s_ratio"] is None


def test_expandable_segments_are_tried_only_where_the_default_allocators_reserved_bytes_ran_out():
    """A side that ran out of memory under a cap its predicted peak fits (s34: FP8 at seq 8192, 70.6 GB allocated, 9 GB
    more reserved under 80 GB) is tried again under expandable segments, only under those caps; nothing else is."""
    xs = capacity.Config.parse("fp8_s8192_mb1_full_xs")
    assert xs.expandable and xs.name == "fp8_s8192_mb1_full_xs" and xs.twin.name == "fp8_s8192_mb1_full"
    assert xs.env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"} and xs.twin.env == {}
    assert xs.flags(32) == xs.twin.flags(32)
    caps = (40, 48, 80)
    twin = _record("fp8_s8192_mb1_full", {"with": 70.5, "without": 80.5}, [("with", 80, False, None, 70.6)])
    twin["runs"][0]["oom_of_the_cap"] = True
    assert capacity.fragmented(twin, "with", caps) == [80] and capacity.fragmented(twin, "without", caps) == []
    assert capacity.compile_it(xs, {}, (1, 2, 4), caps) is None  # the twin not done yet
    assert capacity.compile_it(xs, {twin["config"]: twin}, (1, 2, 4), caps) is True
    record = _record(xs.name, {"with": 70.5, "without": 80.5})
    assert capacity.caps_of_the_side(record, twin, "with", caps) == [80]
    assert capacity.caps_of_the_side(record, twin, "without", caps) == []
    fits = _record("fp8_s4096_mb1_ckpt", {"with": 8.8, "without": 21}, [("with", 40, True, 64_000, 8.8)])
    assert capacity.compile_it(capacity.Config.parse("fp8_s4096_mb1_ckpt_xs"), {fits["config"]: fits}, (1,), caps) is False
    row = {"without": {"config": "fp8_s8192_mb4_ckpt"}, "with": {"config": xs.name}}
    cmd = capacity.paired_command(row, 32, 8, 40)  # one process: both arms under expandable segments
    assert cmd.startswith("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 ") and '"flags"' in cmd


def test_tokens_per_second_carry_the_times_ci_over_to_their_ratio():
    out = paired.tokens_per_s({"median": 25.0, "ci95": [20.0, 30.0], "base_median": 1000.0}, 1000, 2000)
    assert out["tokens_per_s"] == {"base": 1000.0, "arm": 1600.0}
    assert out["tokens_per_s_ratio"]["median"] == 1.6 and out["tokens_per_s_ratio"]["ci95"] == [2 / 1.3, 2 / 1.2]


def test_fresh_clone_reads_pytests_summary_and_finds_its_regions():
    out = "...\n== 297 passed, 5 skipped, 2 warnings in 122.34s (0:02:02) ==\n"
    assert fresh_clone.counts(out) == {"passed": 297, "skipped": 5, "warnings": 2, "seconds": 122.34}
    assert fresh_clone.counts("1 failed, 296 passed, 5 skipped in 108.17s (0:01:48)\n")["passed"] == 296
    assert fresh_clone.minutes(122.6) == "2 min 3 s" and fresh_clone.minutes(17.4) == "17 s"
    for page, names in fresh_clone.PAGES.items():  # each page has its regions; nothing measured changes nothing
        text = (fresh_clone.ROOT / page).read_text()
        assert fresh_clone.rewrite(text, {}, names, page) == text
