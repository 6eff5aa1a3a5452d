"""litgpt training-step benchmark for ShardIntermediates under Thunder FSDP ZeRO-3 with the TransformerEngine executor.

In the spirit of Thunder's ``thunder/benchmarks/benchmark_litgpt.py``: builds a litgpt model from a config name, jits
it with ``executors=[transformer_engine_ex, ...]`` and ``FSDPTransform(ZeRO-3)`` (plus ``ShardIntermediates`` with
``--shard``), runs ``--steps`` AdamW steps on random tokens (different per rank) and writes JSON with, per rank: peak
memory (``torch.cuda.max_memory_allocated``), saved-for-backward bytes (predicted by the plan, and measured with
``torch.autograd.graph.saved_tensors_hooks``: each distinct storage once, a TE quantized tensor counted by its inner
buffers), step times, losses, and the device.

Ranks: ``--backend gloo`` (default) spawns ``--world-size`` processes on this machine, all on GPU
``rank % device_count`` (two gloo ranks share one H200; NCCL refuses that). ``--backend nccl`` expects to be launched
by ``torchrun --nproc-per-node N`` (RANK / WORLD_SIZE / LOCAL_RANK in the environment), one GPU per rank.
Gloo step times are NOT representative of NCCL (gloo moves CUDA tensors through host memory).

Examples::

    python benchmarks/bench_litgpt.py --model-name Llama-2-7b-hf --n-layer 2 --both --out benchmarks/results/x.json
    torchrun --nproc-per-node 8 benchmarks/bench_litgpt.py --backend nccl --shard --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@dataclass
class RunConfig:
    model: str = "litgpt"  # "toy": thunder_fp8shard.testing.toy_models.FakeFP8Llama (fake FP8, no litgpt: CPU runs)
    model_name: str = "Llama-2-7b-hf"
    n_layer: int = 2
    n_embd: int | None = None  # overrides of the named config (to shrink a model for tests)
    intermediate_size: int | None = None
    n_head: int | None = None
    vocab_size: int | None = None
    micro_batch_size: int = 1
    seq_len: int = 1024
    steps: int = 3
    shard: bool = True
    method: str = "slice"
    prefetch: int = 1
    verify: bool = False
    sdpa: bool = False  # Thunder's sdpa executor (flash attention: its backward is not bitwise reproducible)
    te: bool = True  # the TransformerEngine executor (off only for CPU dry runs)
    device: str = "cuda"
    lr: float = 1e-4
    return_grads: bool = False  # return every step's local gradient shards (for bitwise comparisons)
    seed: int = 0
    extra: dict = field(default_factory=dict)  # further ShardIntermediates options (bucket_bytes, comm, ...)


def litgpt_config(cfg: RunConfig):
    from litgpt import Config

    over = {"n_layer": cfg.n_layer, "block_size": max(cfg.seq_len, 16)}
    if cfg.n_embd is not None:
        over["n_embd"] = cfg.n_embd
    if cfg.intermediate_size is not None:
        over["intermediate_size"] = cfg.intermediate_size
    if cfg.n_head is not None:
        over["n_head"] = over["n_query_groups"] = cfg.n_head
    if cfg.vocab_size is not None:
        over["vocab_size"] = over["padded_vocab_size"] = cfg.vocab_size
    return Config.from_name(cfg.model_name, **over)


def _executors(cfg: RunConfig):
    import thunder

    ex = [e for e in thunder.get_default_executors() if cfg.sdpa or e.name != "sdpa"]
    if cfg.te:
        from thunder.executors.transformer_engineex import transformer_engine_ex

        ex = [transformer_engine_ex, *ex]
    return ex


def _phase(rec: dict, name: str, device) -> None:
    """The peak of the phase that just ended and the memory allocated at its end; resets the peak counter."""
    if device.type != "cuda":
        rec[f"peak_{name}"] = rec[f"end_{name}"] = 0
        return
    torch.cuda.synchronize(device)
    rec[f"peak_{name}"] = torch.cuda.max_memory_allocated(device)
    rec[f"end_{name}"] = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)


@dataclass
class RankSetup:
    """One rank's jitted model, optimizer and pass (None without ``shard``), as ``run_rank`` and
    ``plan_accuracy.py`` train them."""

    jm: object
    opt: torch.optim.Optimizer
    shard: object
    device: torch.device
    vocab_size: int  # token ids are drawn below this
    n_params: int


def setup_rank(rank: int, cfg: RunConfig) -> RankSetup:
    """Builds the model (litgpt from ``cfg.model_name``; ``cfg.model == "toy"``: ``toy_models.FakeFP8Llama``, for the
    CPU), jits it with Thunder FSDP ZeRO-3 (and TE, and the pass), and makes its AdamW optimizer."""
    import thunder
    from thunder.distributed import FSDPType
    from thunder.distributed.transforms.fsdp_v2 import FSDPTransform

    from thunder_fp8shard import ShardIntermediates

    if cfg.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    torch.manual_seed(cfg.seed)  # same initial weights on every rank
    if cfg.model == "toy":
        from thunder_fp8shard.testing.toy_models import FakeFP8Llama

        sizes = {k: v for k, v in dict(n_embd=cfg.n_embd, n_head=cfg.n_head, intermediate_size=cfg.intermediate_size,
                                       vocab_size=cfg.vocab_size).items() if v is not None}
        with device:
            model = FakeFP8Llama(cfg.n_layer, **sizes)
        vocab = model.lm_head.out_features
    else:
        from litgpt.model import GPT

        lcfg = litgpt_config(cfg)
        with device:
            model = GPT(lcfg)
        model = model.to(torch.bfloat16)
        vocab = lcfg.vocab_size
    n_params = sum(p.numel() for p in model.parameters())

    transforms = []
    if cfg.te:
        from thunder.executors.transformer_engineex import TransformerEngineTransform

        transforms.append(TransformerEngineTransform())
    transforms.append(FSDPTransform(device=device, sharding_strategy=FSDPType.ZERO3))
    sh = None
    if cfg.shard:
        options = {"optimizer_states": 2, **cfg.extra}  # the optimizer below is AdamW: two states a parameter
        sh = ShardIntermediates(method=cfg.method, prefetch=cfg.prefetch, verify=cfg.verify, **options)
        transforms.append(sh)
    jm = thunder.jit(model, executors=_executors(cfg), transforms=transforms)
    opt = torch.optim.AdamW(jm.parameters(), lr=cfg.lr)
    return RankSetup(jm, opt, sh, device, vocab, n_params)


def run_rank(rank: int, world_size: int, cfg: RunConfig) -> dict:
    """One rank's run; the process group is already initialized. Returns picklable results."""
    from thunder_fp8shard.testing.measure import saved_bytes

    s = setup_rank(rank, cfg)
    jm, opt, sh, device, n_params = s.jm, s.opt, s.shard, s.device, s.n_params
    gen = torch.Generator().manual_seed(1000 + rank)  # different data on every rank
    losses, times, peaks, saved, grads, phases = [], [], [], [], [], []
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for step in range(cfg.steps):
        idx = torch.randint(0, s.vocab_size, (cfg.micro_batch_size, cfg.seq_len + 1), generator=gen).to(device)
        x, y = idx[:, :-1], idx[:, 1:]
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        sync()
        t0 = time.perf_counter()
        phase = {}
        with saved_bytes() as sb:
            logits = jm(x)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        _phase(phase, "forward", device)
        loss.backward()
        _phase(phase, "backward", device)
        if cfg.return_grads:
            grads.append({n: p.grad.detach().cpu().clone() for n, p in jm.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad(set_to_none=True)
        _phase(phase, "optimizer", device)
        phases.append(phase)
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(loss.detach().float().cpu().item())
        saved.append(sb.total)
        peaks.append(max(v for k, v in phase.items() if k.startswith("peak_")))
        del logits, loss

    out = {
        "rank": rank, "world_size": world_size, "n_params": n_params,
        "peak_bytes_per_step": peaks, "peak_bytes": max(peaks[1:] or peaks),
        "saved_bytes_measured_per_step": saved, "saved_bytes_measured": saved[-1],
        "step_time_s": times, "step_time_median_s_after_first": statistics.median(times[1:] or times),
        "memory_phases_per_step": phases, "losses": losses, "losses_hex": [float(v).hex() for v in losses],
    }
    if cfg.return_grads:
        out["grads"] = grads
    if sh is not None and sh.plans:
        plan = sh.plans[-1]
        out["plan"] = {
            "text": str(plan), "saved_bytes_before": plan.saved_bytes_before, "saved_bytes_after": plan.saved_bytes_after,
            "predicted_saving": plan.saved_bytes_before - plan.saved_bytes_after,
            # the ranks each copy is sharded over (shard_group_size; the world size by default) and what each rank
            # all-gathers in backward per step
            "shard_group_size": plan.k, "gathered_bytes_per_step": plan.gathered_bytes_per_step,
            "predicted_peak_before": getattr(plan, "peak_bytes_before", None),
            "predicted_peak_after": getattr(plan, "peak_bytes_after", None),
            "decisions": [{**asdict(d), "shape": list(d.shape), "bytes_saved": d.bytes_saved} for d in plan.decisions],
        }
        if rank == 0:
            print(plan, flush=True)
    return out


def device_info() -> dict:
    info = {"torch": torch.__version__}
    try:
        import thunder

        info["thunder"] = thunder.__version__
    except Exception:  # pragma: no cover
        pass
    try:
        import transformer_engine

        info["transformer_engine"] = transformer_engine.__version__
    except Exception:
        info["transformer_engine"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(device=torch.cuda.get_device_name(0), device_memory_bytes=p.total_memory,
                    capability=f"{p.major}.{p.minor}", device_count=torch.cuda.device_count())
    else:
        info["device"] = "cpu"
    return info


def _summary(ranks: list[dict], cfg: RunConfig, backend: str) -> dict:
    res = {
        "config": asdict(cfg), "backend": backend,
        "timing_note": ("gloo over CUDA tensors moves every collective through host memory: step times are NOT "
                        "representative of NCCL") if backend == "gloo" else "NCCL",
        "ranks": [{k: v for k, v in r.items() if k != "grads"} for r in ranks],
        "peak_bytes_max_over_ranks": max(r["peak_bytes"] for r in ranks),
        "saved_bytes_measured_per_rank": [r["saved_bytes_measured"] for r in ranks],
    }
    if "plan" in ranks[0]:
        res["saved_bytes_predicted_before"] = ranks[0]["plan"]["saved_bytes_before"]
        res["saved_bytes_predicted_after"] = ranks[0]["plan"]["saved_bytes_after"]
        res["te_weight_bytes_saved_for_backward"] = sum(
            d["nbytes"] for d in ranks[0]["plan"]["decisions"] if d["kind"] == "te_float8" and d["replicated"])
    return res


def run(cfg: RunConfig, world_size: int, backend: str) -> dict:
    """Runs one configuration on all ranks; returns the summary (on every rank under torchrun)."""
    if backend == "gloo":
        from thunder_fp8shard.testing.harness import run_on_ranks

        ranks = run_on_ranks(run_rank, world_size, cfg)
    else:
        ranks = _run_torchrun(cfg)
    return _summary(ranks, cfg, backend)


def _run_torchrun(cfg: RunConfig) -> list[dict]:
    if not dist.is_initialized():
        dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = run_rank(rank, world, cfg)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    return everyone


def compare(without: dict, with_: dict) -> dict:
    """Memory reduction next to the target: >= 95% of (k-1)/k x the saved FP8 weight bytes (k: the ranks each copy is
    sharded over, the world size N unless shard_group_size says otherwise)."""
    n = with_["ranks"][0]["world_size"]
    k = with_["ranks"][0].get("plan", {}).get("shard_group_size", n)
    fp8w = with_.get("te_weight_bytes_saved_for_backward", 0)
    per_rank = []
    for a, b in zip(without["ranks"], with_["ranks"]):
        red = a["peak_bytes"] - b["peak_bytes"]
        per_rank.append({"rank": a["rank"], "peak_without": a["peak_bytes"], "peak_with": b["peak_bytes"],
                         "peak_reduction": red,
                         "saved_measured_without": a["saved_bytes_measured"],
                         "saved_measured_with": b["saved_bytes_measured"],
                         "saved_reduction_measured": a["saved_bytes_measured"] - b["saved_bytes_measured"]})
    target = 0.95 * (k - 1) / k * fp8w
    worst = min(r["peak_reduction"] for r in per_rank)
    return {
        "world_size": n, "shard_group_size": k, "te_fp8_weight_bytes_saved_for_backward": fp8w,
        "predicted_saved_reduction": with_.get("saved_bytes_predicted_before", 0) - with_.get("saved_bytes_predicted_after", 0),
        "target_peak_reduction_bytes": target, "worst_rank_peak_reduction_bytes": worst,
        "target_met": bool(fp8w > 0 and worst >= target), "per_rank": per_rank,
        "losses_bitwise_equal": [a["losses_hex"] == b["losses_hex"] for a, b in zip(without["ranks"], with_["ranks"])],
    }


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The litgpt model and batch shape arguments, shared with ``te_peer.py``."""
    p.add_argument("--model-name", default="Llama-2-7b-hf")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int)
    p.add_argument("--intermediate-size", type=int)
    p.add_argument("--n-head", type=int)
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=1024)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--world-size", type=int, default=2, help="gloo: ranks to spawn (torchrun sets it for nccl)")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--shard", action=argparse.BooleanOptionalAction, default=True, help="with/without the pass")
    p.add_argument("--both", action="store_true", help="run without and with the pass, and compare")
    p.add_argument("--method", choices=("slice", "reduce_scatter"), default="slice")
    p.add_argument("--prefetch", type=int, default=1)
    p.add_argument("--verify", action="store_true")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--sdpa", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--te", action=argparse.BooleanOptionalAction, default=True, help="--no-te: CPU dry runs only")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", help="JSON path")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    a = parse_args(argv)
    cfg = RunConfig(model_name=a.model_name, n_layer=a.n_layer, n_embd=a.n_embd, intermediate_size=a.intermediate_size,
                    n_head=a.n_head, vocab_size=a.vocab_size, micro_batch_size=a.micro_batch_size, seq_len=a.seq_len,
                    steps=a.steps, shard=a.shard, method=a.method, prefetch=a.prefetch, verify=a.verify, sdpa=a.sdpa,
                    te=a.te, device=a.device)
    world = int(os.environ.get("WORLD_SIZE", a.world_size)) if a.backend == "nccl" else a.world_size
    result = {"device": device_info(), "world_size": world}
    if a.both:
        from dataclasses import replace

        result["without"] = run(replace(cfg, shard=False), world, a.backend)
        result["with"] = run(replace(cfg, shard=True), world, a.backend)
        result["comparison"] = compare(result["without"], result["with"])
    else:
        result["with" if cfg.shard else "without"] = run(cfg, world, a.backend)
    is_zero = a.backend == "gloo" or dist.get_rank() == 0
    if is_zero:
        text = json.dumps(result, indent=1, default=str)
        if a.out:
            os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
            with open(a.out, "w") as f:
                f.write(text)
        if "comparison" in result:
            print(json.dumps(result["comparison"], indent=1), flush=True)
    if a.backend == "nccl" and dist.is_initialized():
        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
