"""ShardIntermediates with TransformerEngine on the GPU (skipped without CUDA and TransformerEngine).

Two gloo ranks share the one GPU (NCCL refuses two ranks on one device), each with its own data. The model is
litgpt's ``Llama-2-7b-hf`` config with ``n_layer=2``, shrunk to keep the test fast: n_embd 1024, 8 heads,
intermediate 2816, vocab 4096, sequence 256, micro batch 2, bf16, under ``FSDPTransform(ZeRO-3)`` (or ZeRO-2, DDP,
FSDP2 under ThunderFX) with the executors of Thunder's benchmark (``--compile=thunder_inductor_cat``: TE's, then
``torch_compile_cat_ex``, then Thunder's defaults; DelayedScaling, the default recipe) and Thunder's sdpa executor
left out (flash-attention backward is not bitwise reproducible run to run). Three AdamW steps with and without the
pass must give bitwise equal losses and gradients. Memory and saved-bytes figures are printed (run pytest with
``-s`` to see them in the log). TE's GEMM workspace must be measured, not left out: in a fresh process (its size,
and TE's GEMMs reuse it) and in each plan.

The device peak is asserted under torch's fake process group (one process plays rank 0 of 2), not over gloo, whose
CUDA collectives stage through host buffers on streams of their own: under the fake group the pass's all-gathers
are copies on the compute stream, as NCCL's memory would be. The peak must fall by at least 90% of the plan's
predicted reduction, and never rise. (On the H200, 2026-12-02, it rose by 14-22 MB under the fake group as under
gloo: a CUDA memory history, ``benchmarks/memory_at_peak.py``, showed every step beginning 33.8 MB higher, the size
of one of the 32 MiB cuBLAS workspaces the pass forced while compiling; the pass now releases the workspaces it
measures. That fix has not run on the device yet.)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

pytestmark = pytest.mark.gpu

te = pytest.importorskip("transformer_engine.pytorch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from thunder_fp8shard.testing import litgpt_run as bench  # noqa: E402
from thunder_fp8shard.testing.harness import run_on_ranks, run_simulated  # noqa: E402

SMALL = dict(bench.TINY, steps=3, return_grads=True)


def test_payload_roundtrip_float8tensor():
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer
    import transformer_engine_torch as tex

    from thunder_fp8shard import payload

    q = Float8Quantizer(scale=torch.full((1,), 2.0, device="cuda"), amax=torch.zeros(1, device="cuda"),
                        fp8_dtype=tex.DType.kFloat8E4M3)
    x = torch.randn(64, 96, device="cuda", dtype=torch.bfloat16)
    for rowwise, columnwise in ((True, True), (False, True), (True, False)):
        q.set_usage(rowwise=True, columnwise=columnwise or not rowwise)
        f = q(x)  # TE 2.20 cannot quantize columnwise-only: drop the rowwise copy afterwards
        if not rowwise:
            f.update_usage(rowwise_usage=False, columnwise_usage=True)
            assert f._data is None and f._transpose is not None
        before = f.dequantize()
        present = {a: getattr(f, a) for a in ("_data", "_transpose") if getattr(f, a) is not None}
        buffers, member = payload.take(f)
        assert member.kind == "te_float8" and len(buffers) == len(present)
        assert all(getattr(f, a) is None for a in present)  # the object no longer holds its large buffers
        assert sum(b.numel() * b.element_size() for b in buffers) == x.numel() * len(present)
        gathered = [b.clone() for b in buffers]  # stands for views of the all-gathered bytes
        g = payload.give(member, gathered)
        assert g is f and all(getattr(g, a) is t for a, t in zip(present, gathered))
        assert g._scale_inv is not None and torch.equal(g.dequantize(), before)


# In a process that has run no TE GEMM: measure() forces TE's GEMM workspace (TE >= 2.10:
# cpp_extensions.gemm.get_cublas_workspace, an lru_cache of torch.empty, i.e. PyTorch's caching allocator), then TE
# GEMMs (BasicLinear's functional forward and backward, the path of Thunder's TE executor) run and must find it.
FRESH_PROCESS = textwrap.dedent("""
    import json
    import torch
    from thunder.core import devices, dtypes
    from thunder.core.proxies import TensorProxy
    from thunder.core.trace import TraceCtx, tracectx
    from transformer_engine.pytorch.cpp_extensions import gemm
    from transformer_engine.pytorch.ops.basic.basic_linear import BasicLinear
    from thunder_fp8shard.device_memory import measure

    trace = TraceCtx()
    with tracectx(trace):
        trace.args = (TensorProxy("x", shape=(4, 4), dtype=dtypes.bfloat16, device=devices.to_device("cuda:0"),
                                  requires_grad=False),)
    cache = gemm.get_cublas_workspace
    before = cache.cache_info()._asdict()
    m = measure(trace, transformer_engine=True)
    forced = cache.cache_info()._asdict()
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    y, _, _ = BasicLinear._functional_forward(x, w, dtype=torch.bfloat16)
    BasicLinear._functional_backward(torch.ones_like(y), x, w, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    print("RESULT " + json.dumps({
        "workspaces": m.workspaces, "not_forced": m.not_forced, "size": gemm.get_cublas_workspace_size_bytes(),
        "cache_before": before, "cache_forced": forced, "cache_after_gemms": cache.cache_info()._asdict(),
    }))
""")


def test_te_gemm_workspace_is_measured_in_a_fresh_process():
    """TE 2.20's GEMM workspace is forced and measured (never the 0 B or the warning of a missing API), its bytes are
    its size, and TE's GEMMs afterwards reuse it: no second workspace is created."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", FRESH_PROCESS], capture_output=True, text=True, env=env, timeout=600,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    r = json.loads(done.stdout.split("RESULT ", 1)[1])
    print("TE_WORKSPACE_REPORT " + json.dumps(r))
    kinds = dict(r["workspaces"])
    assert r["not_forced"] == [], r["not_forced"]
    assert r["size"] == 32 * 1024 * 1024 + 1024  # compute capability >= 9.0 (the H200)
    # the allocator gained the workspace (rounded to the allocator's 512 B blocks, at most one more 2 MiB slab)
    assert r["size"] <= kinds["TransformerEngine GEMM"] < r["size"] + (2 << 20), kinds
    assert r["cache_before"]["currsize"] == 0 and r["cache_forced"]["currsize"] == 1
    after = r["cache_after_gemms"]
    assert after["currsize"] == 1 and after["misses"] == 1 and after["hits"] >= 3, after  # fwd, dgrad, wgrad


def _assert_te_workspace_measured(plan_text: str):
    """The plan's persistent workspaces hold TE's GEMM workspace, measured (the rank's first compilation)."""
    found = re.search(r"TransformerEngine GEMM ([\d,]+) B", plan_text)
    assert found and int(found.group(1).replace(",", "")) >= 32 * 1024 * 1024 + 1024, found
    assert "TransformerEngine GEMM workspace" not in plan_text  # no unknown term: forcing it did not fail


def _run(shard: bool, backend: str = "gloo", **options):
    cfg = bench.RunConfig(**SMALL, shard=shard, extra=options)
    return run_on_ranks(bench.run_rank, 2, cfg, backend=backend)


def _assert_weight_copies_sharded(plan):
    """Every TE weight copy is sharded but the lm_head's: it is the last forward and the first backward consumer,
    so its all-gather would be issued right after its shard (nothing to overlap it with)."""
    weights = [d for d in plan["decisions"] if d["kind"] == "te_float8" and d["replicated"]]
    assert len(weights) == 5 * SMALL["n_layer"] + 1  # qkv, attn proj, fc_1, fc_2, mlp proj per layer, and lm_head
    # and each layer's v, a view of its qkv out of the cat executor's torch.compile region, is compacted
    assert plan["compacted"] == SMALL["n_layer"], plan["text"]
    refused = [d for d in weights if not d["sharded"]]
    assert [d["shape"] for d in refused] == [[SMALL["vocab_size"], SMALL["n_embd"]]], refused
    assert refused[0]["reason"].startswith("idle interval too short")
    return weights


def _assert_bitwise_equal_and_nonzero(without, with_):
    bench.assert_bitwise_equal_and_nonzero(without, with_, SMALL["steps"])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL, one GPU a rank)")
@pytest.mark.parametrize("options", [{}, {"bucket_bytes": 0, "comm": "dedicated"}], ids=["defaults", "singles"])
def test_llama_zero3_te_nccl_two_gpus_bitwise(options):
    """NCCL, one GPU a rank, different data per rank, decomposed attention: losses and every gradient of three
    AdamW steps are bitwise equal with and without the pass (the defaults: buckets and shard ops grouped on the
    memory model, on FSDP's group; or one tensor a bucket on a dedicated group), and every gradient is non-zero."""
    without, with_ = _run(False, "nccl"), _run(True, "nccl", **options)
    _assert_bitwise_equal_and_nonzero(without, with_)
    plan = with_[0]["plan"]
    _assert_weight_copies_sharded(plan)
    _assert_te_workspace_measured(plan["text"])
    for a, b in zip(without, with_):
        assert b["saved_bytes_measured"] < a["saved_bytes_measured"]
    print("NCCL_REPORT " + json.dumps({"losses": [r["losses"] for r in with_], "plan": plan["text"]}))


def test_llama_zero3_te_bitwise_and_memory():
    without = _run(False)
    with_ = _run(True)
    _assert_bitwise_equal_and_nonzero(without, with_)
    report = {"model": "litgpt Llama-2-7b-hf config, shrunk: " + json.dumps(SMALL), "ranks": []}
    for a, b in zip(without, with_):
        r, ga = a["rank"], a["grads"][-1]
        nonzero = sum(1 for n in ga if float(ga[n].abs().sum()) > 0)
        report["ranks"].append({
            "rank": r, "losses": a["losses"], "grads_bitwise_equal": True, "nonzero_grad_tensors_last_step": nonzero,
            "n_grad_tensors": len(ga),
            "peak_bytes_without": a["peak_bytes"], "peak_bytes_with": b["peak_bytes"],
            "saved_measured_without": a["saved_bytes_measured"], "saved_measured_with": b["saved_bytes_measured"],
            "saved_predicted_before": b["plan"]["saved_bytes_before"], "saved_predicted_after": b["plan"]["saved_bytes_after"],
        })

    plan = with_[0]["plan"]
    te_dec = [d for d in plan["decisions"] if d["kind"] == "te_float8"]
    inputs = [d for d in te_dec if not d["replicated"]]
    print(plan["text"])
    weights = _assert_weight_copies_sharded(plan)
    _assert_te_workspace_measured(plan["text"])
    assert inputs and not any(d["sharded"] for d in inputs), "TE quantized inputs are per-rank: never sharded"
    assert all("per-rank" in d["reason"] for d in inputs)
    fp8w = sum(d["nbytes"] for d in weights)
    report["te_fp8_weight_bytes"] = fp8w
    report["predicted_saving"] = plan["predicted_saving"]
    report["refused_input_reasons"] = sorted({d["reason"] for d in inputs})
    for rr in report["ranks"]:
        rr["measured_saving"] = rr["saved_measured_without"] - rr["saved_measured_with"]
        rr["peak_reduction"] = rr["peak_bytes_without"] - rr["peak_bytes_with"]
        rr["target_peak_reduction"] = 0.95 * 0.5 * fp8w
    print("TE_GPU_REPORT " + json.dumps(report, indent=1))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "test_te_gpu_report.json"), "w") as f:
            json.dump(report, f, indent=1)
    # the plan's prediction must match what autograd saved; the measurement also sees each sharded TE tensor's
    # fp32[1] scale_inv leave the saved tensors (it moves, whole, into the restorer)
    n_sharded = sum(1 for d in weights if d["sharded"])
    for rr in report["ranks"]:
        assert rr["measured_saving"] == report["predicted_saving"] + 4 * n_sharded, rr
    # the replication analysis understands reshapes: each refused quantized input is traced to the rank's input
    for d in inputs:
        assert "the rank's input" in d["reason"] and "does not understand" not in d["reason"], d["reason"]


@pytest.mark.parametrize("setup", ["zero2", "ddp"])
def test_llama_te_zero2_and_ddp_bitwise(setup):
    """Thunder FSDP ZeRO-2 and Thunder DDP with the TE executor, two gloo ranks on the one GPU, different data per
    rank: losses and every gradient of three AdamW steps bitwise equal with and without the pass, all non-zero; every
    TE weight copy but the lm_head's sharded, and the saved bytes fall by what the plan predicts. (Its training run is
    checked on the CPU with the toy model too, ``tests/test_litgpt_run.py``; passed on the H200 on 2026-12-02.)"""
    cfg = dict(SMALL, setup=setup)
    without = run_on_ranks(bench.run_rank, 2, bench.RunConfig(**cfg, shard=False), backend="gloo")
    with_ = run_on_ranks(bench.run_rank, 2, bench.RunConfig(**cfg, shard=True), backend="gloo")
    _assert_bitwise_equal_and_nonzero(without, with_)
    plan = with_[0]["plan"]
    weights = _assert_weight_copies_sharded(plan)
    n_sharded = sum(1 for d in weights if d["sharded"])
    for a, b in zip(without, with_):
        assert a["saved_bytes_measured"] - b["saved_bytes_measured"] == plan["predicted_saving"] + 4 * n_sharded
    print(f"TE_GPU_SETUP_REPORT {setup} " + json.dumps({"losses": [r["losses"] for r in with_],
                                                        "peaks": [[a["peak_bytes"], b["peak_bytes"]] for a, b in zip(without, with_)],
                                                        "plan": plan["text"].splitlines()[0]}))


def test_llama_te_fsdp2_under_thunderfx_bitwise():
    """PyTorch FSDP2 (``fully_shard`` each block and the model) compiled by ThunderFX with the TE executor and
    transform, the pass last; two gloo ranks on the one GPU, different data per rank: losses and every gradient
    (each rank's DTensor shard) of three AdamW steps bitwise equal with and without the pass, all non-zero, and the
    saved bytes fall by what the subgraphs' plans predict. (Its training run is checked on the CPU with the toy model
    too, ``tests/test_litgpt_run.py``; passed on the H200 on 2026-12-02.)"""
    cfg = dict(SMALL, setup="fsdp2")
    without = run_on_ranks(bench.run_rank, 2, bench.RunConfig(**cfg, shard=False), backend="gloo")
    with_ = run_on_ranks(bench.run_rank, 2, bench.RunConfig(**cfg, shard=True), backend="gloo")
    _assert_bitwise_equal_and_nonzero(without, with_)
    # every block's five TE weight copies: one subgraph (one plan) serves both blocks, so its plan counts twice
    assert with_[0]["sharded_total"] == 5 * SMALL["n_layer"] and with_[0]["compacted_total"] == SMALL["n_layer"]
    # the blocks' plan runs twice a step, any other plan once (with TE the head's subgraph has no candidate: on the
    # H200, 2026-12-02, its plans ran [2] a step)
    runs = sorted(with_[0]["runs_per_step"])
    assert runs[-1] == 2 and all(r == 1 for r in runs[:-1]), runs
    for a, b in zip(without, with_):
        assert a["saved_bytes_measured"] - b["saved_bytes_measured"] == b["predicted_saving_total"] + 4 * b["sharded_total"]
    print("TE_GPU_SETUP_REPORT fsdp2 " + json.dumps({"losses": [r["losses"] for r in with_], "plans": with_[0]["plans"],
                                                    "sharded": with_[0]["sharded_total"]}))


@pytest.mark.parametrize("setup", ["zero3", "zero2", "ddp", "fsdp2"])
def test_llama_te_device_peak_falls_as_planned_under_the_fake_process_group(setup):
    """Rank 0 of 2 under torch's fake process group (memory as on two GPUs, the pass's all-gathers copies on the
    compute stream; see the module's docstring for why not gloo): the forward+backward peak (``max_memory_allocated``,
    the steps after the first) falls by at least 90% of the plan's predicted reduction, and never rises. Under FSDP2
    no plan sees the step (one a subgraph, see the README), so no reduction of the step's peak is predicted: there it
    must fall, and never rise; what share of the plans' saved-bytes reduction (each counted once per run) it reached
    is reported (on the H200, 2026-12-02: 78%; where in the step the peak fell was not measured)."""
    cfg = dict(SMALL, setup=setup, return_grads=False)
    without = run_simulated(bench.run_rank, 2, bench.RunConfig(**cfg, shard=False))
    with_ = run_simulated(bench.run_rank, 2, bench.RunConfig(**cfg, shard=True))
    plan = with_["plan"]
    if setup == "fsdp2":
        predicted = None
        saved_reduction = with_["predicted_saving_total"]
    else:
        predicted = plan["predicted_peak_before"] - plan["predicted_peak_after"]
        saved_reduction = plan["predicted_saving"]
    measured = without["program_peak_bytes"] - with_["program_peak_bytes"]
    report = {"setup": setup, "program_peak_without": without["program_peak_bytes"],
              "program_peak_with": with_["program_peak_bytes"], "measured_reduction": measured,
              "predicted_reduction": predicted, "predicted_saved_bytes_reduction": saved_reduction,
              "predicted_peak": [plan["predicted_peak_before"], plan["predicted_peak_after"]],
              "compacted": plan["compacted"], "audit": plan["audit"], "calibration": plan["calibration"]}
    print(f"TE_GPU_PEAK_REPORT {setup} " + json.dumps(report))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"test_te_gpu_peak_{setup}.json"), "w") as f:
            json.dump(report, f, indent=1)
    assert with_["program_peak_bytes"] <= without["program_peak_bytes"], report
    if predicted is None:
        assert measured > 0, report
    else:
        assert predicted > 0, plan["text"]
        assert measured >= 0.9 * predicted, report
