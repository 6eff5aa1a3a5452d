"""The benchmark tooling (not the pass): the profile summary's gap classes and the comparison's medians."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import profile_summary  # noqa: E402
import thunder_litgpt  # noqa: E402


def _k(name, ts, dur, stream, corr):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream, "correlation": corr}}


def _launch(ts, corr):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 2, "args": {"correlation": corr}}


def test_profile_summary_tells_cpu_starved_gaps_from_waits():
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
    s = profile_summary.summarize({"traceEvents": events})
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
