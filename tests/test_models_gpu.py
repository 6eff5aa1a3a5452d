"""More model families on the device: Thunder's own benchmark, with and without the pass (skipped without CUDA and
TransformerEngine, but for the configuration checks at the end, which run on the CPU).

Each model runs ``benchmarks/paired.py --one-model`` in a process of its own: litgpt's config of that name at 8 layers,
TransformerEngine FP8 (``--low_precision_mode=fp8-default-te``), Thunder FSDP ZeRO-3, ``--compile=thunder_inductor_cat``,
rank 0 of 8 simulated ranks (torch's fake process group: memory as on 8 GPUs, no communication). One model is built
and compiled (the arm without the pass); the arm with the pass is a program of it (the base's traces rewritten by the
pass: seconds, not a second compilation), and both arms' iterations alternate in the same resident memory. Memory
only: a few iterations, no timing is asserted.

Per model it asserts that the device peak (the median of the timed iterations' ``max_memory_allocated``) falls with
the pass by at least 90% of what the plan predicts (its predicted peak before minus after, which must be positive),
that the plan's predicted peak is within ±2% of the measured one for both arms (the peak before for the arm without
the pass, the peak after for the arm with it), and that the run agrees with the plan: the run-time audit found the
storages the plan modelled as saved (no difference) and the calibration's device reading is within ±2% of the
prediction. A JSON per model (``test_models_gpu_<model>.json``) and paired.py's own JSONs (its ``"kind":
"plan_accuracy"`` reports among them) are written into ``$OUT`` where it is set, before the assertions.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# model name (litgpt's config) -> Thunder's benchmark's flags besides the common ones. Llama-3-8B: grouped-query
# attention (32 heads, 8 groups), its default sequence of 8192. Qwen2.5-7B: another family, grouped-query attention
# with 28 heads in 4 groups and a bias on the qkv projection; its config's sequence (131072) cut to Llama-3-8B's.
MODELS = {
    "Llama-3-8B": [],
    "Qwen2.5-7B": ["--block_size=8192"],
}
N_LAYERS = 8
WORLD_SIZE = 8
COMMON = ["--distributed_mode=fsdp", "--shard_mode=zero3", "--micro_batch_size=1", "--compile=thunder_inductor_cat",
          "--low_precision_mode=fp8-default-te", f"--n_layers={N_LAYERS}"]
ARMS = {"without": None, "with": {"optimizer_states": 2}}
REDUCTION_SHARE = 0.9  # the measured peak reduction's least share of the predicted one
ACCURACY_PCT = 2.0  # the largest |predicted - measured| / measured peak, in percent


def benchmark_flags(model: str) -> list[str]:
    return [*COMMON, f"--model_name={model}", *MODELS[model]]


def paired_command(model: str, out_prefix: str) -> list[str]:
    """``paired.py``'s command line for one model: both arms, one model, memory only (a few iterations)."""
    return [sys.executable, os.path.join(ROOT, "benchmarks", "paired.py"), "--simulate", str(WORLD_SIZE), "--one-model",
            "--timed", "4", "--warmup", "2", "--warmup-quads", "1", "--arms", json.dumps(ARMS), "--out", out_prefix,
            "--", *benchmark_flags(model)]


def _slug(model: str) -> str:
    return model.replace(".", "_").replace("-", "_").lower()


def _needs_cuda_and_te():
    """The device test's skip: without CUDA, or without TransformerEngine."""
    import torch

    if not torch.cuda.is_available():
        return "needs CUDA"
    if importlib.util.find_spec("transformer_engine") is None:
        return "needs TransformerEngine"
    return None


@pytest.mark.gpu
@pytest.mark.parametrize("model", list(MODELS))
def test_model_peak_falls_as_planned_and_the_plan_is_accurate(model, tmp_path):
    why = _needs_cuda_and_te()
    if why:
        pytest.skip(why)
    out_dir = os.environ.get("OUT") or str(tmp_path)
    prefix = os.path.join(out_dir, f"models_{_slug(model)}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1"}
    cmd = paired_command(model, prefix)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1500)
    with open(f"{prefix}.log", "w") as f:
        f.write(done.stdout + "\n---- stderr ----\n" + done.stderr)
    assert done.returncode == 0, f"paired.py failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"

    with open(f"{prefix}_with.json") as f:
        run = json.load(f)
    accuracy = {}
    for arm in ARMS:
        with open(f"{prefix}_accuracy_{arm}.json") as f:
            accuracy[arm] = json.load(f)
    plan = next(a for a in run["arms"] if a["name"] == "with")["plan"]
    predicted = run["predicted_peak_GB"]["before"] - run["predicted_peak_GB"]["after"]
    measured = run["measured_peak_GB"]["base"] - run["measured_peak_GB"]["arm"]
    audit, calibration = plan["audit"], plan["calibration"]
    report = {
        "kind": "device_model", "model": model, "simulated": True, "world_size": WORLD_SIZE, "n_layers": N_LAYERS,
        "flags": run["flags"], "device": run["device"], "launch": " ".join(cmd[1:]),
        "measured_peak_GB": run["measured_peak_GB"], "predicted_peak_GB": run["predicted_peak_GB"],
        "measured_reduction_GB": measured, "predicted_reduction_GB": predicted,
        "error_pct": {arm: accuracy[arm]["error_pct"] for arm in ARMS},
        "candidates": plan["candidates"], "sharded": plan["sharded"], "sharded_bytes": plan["sharded_bytes"],
        "compactions": plan["compactions"], "audit": audit, "calibration": calibration, "notes": plan["notes"],
        "plan": plan["text"],
    }
    print(f"MODEL_REPORT {model} " + json.dumps({k: v for k, v in report.items() if k != "plan"}))
    with open(os.path.join(out_dir, f"test_models_gpu_{_slug(model)}.json"), "w") as f:
        json.dump(report, f, indent=1)

    assert predicted > 0, plan["text"]
    assert measured >= REDUCTION_SHARE * predicted, report
    for arm in ARMS:
        assert abs(accuracy[arm]["error_pct"]) <= ACCURACY_PCT, (arm, accuracy[arm]["error_pct"], report)
    assert audit is not None and not audit["differences"], audit
    assert calibration is not None and abs(calibration["error_pct"]) <= ACCURACY_PCT, calibration


# ---- on the CPU: the models' configurations and the benchmark's flags ------------------------------------------------


def _benchmark_parameters() -> set[str]:
    """The keyword parameters of Thunder's ``Benchmark_litGPT.__init__``, read from its source (importing the module
    initializes a process group and picks a CUDA device)."""
    spec = importlib.util.find_spec("thunder.benchmarks.benchmark_litgpt")
    with open(spec.origin) as f:
        tree = ast.parse(f.read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Benchmark_litGPT")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return {a.arg for a in init.args.args[1:] + init.args.kwonlyargs}


@pytest.mark.parametrize("model", list(MODELS))
def test_model_config_and_flags(model, monkeypatch):
    """Every flag is a parameter of Thunder's benchmark; the config resolves in the installed litgpt, has grouped-query
    attention, and every linear layer's dimensions are multiples of 16 (TransformerEngine's FP8 GEMMs need them; the
    benchmark pads only the vocabulary)."""
    import torch

    # importing litgpt imports lightning, whose fabric replaces torch.compile in this process (its wrapper deep-copies
    # the backend's arguments: a later test's ProcessGroup cannot be); monkeypatch puts torch's back after this test
    monkeypatch.setattr(torch, "compile", torch.compile)
    Config = pytest.importorskip("litgpt").Config  # litgpt is the device image's (and a dev install's), not the test extra's

    params = _benchmark_parameters()
    flags = dict(f[2:].split("=", 1) for f in benchmark_flags(model))
    assert set(flags) <= params, set(flags) - params
    over = {"n_layer": int(flags["n_layers"])}
    if "block_size" in flags:
        over["block_size"] = int(flags["block_size"])
    c = Config.from_name(flags["model_name"], **over)
    assert c.n_layer == N_LAYERS and c.block_size <= 8192
    assert 1 < c.n_query_groups < c.n_head, (c.n_head, c.n_query_groups)
    qkv = (c.n_head + 2 * c.n_query_groups) * c.head_size
    dims = [c.n_embd, qkv, c.head_size * c.n_head, c.intermediate_size]
    assert all(d % 16 == 0 for d in dims), dims
