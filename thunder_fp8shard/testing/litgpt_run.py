"""One rank's training run of a litgpt model (or the fake-FP8 toy) with TransformerEngine, under any supported setup,
with or without the pass: for the GPU exactness tests and ``benchmarks/plan_accuracy.py``."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from thunder_fp8shard.planning.planner import RAISES
from thunder_fp8shard.reporting.plan_text import plan_text
from thunder_fp8shard.testing.trained import trained


# the GPU tests' shrunk Llama-2-7b-hf: RunConfig overrides
TINY = dict(n_layer=2, n_embd=1024, n_head=8, intermediate_size=2816, vocab_size=4096, seq_len=256, micro_batch_size=2)


@dataclass
class RunConfig:
    model: str = "litgpt"  # "toy": toy_models.FakeFP8Llama (no litgpt: CPU runs)
    model_name: str = "Llama-2-7b-hf"
    n_layer: int = 2
    n_embd: int | None = None  # overrides of the named config
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
    sdpa: bool = False  # Thunder's sdpa executor (flash attention's backward is not bitwise reproducible)
    te: bool = True  # off only for CPU dry runs
    cat: bool = True  # Thunder's benchmark's torch_compile_cat_ex first (on the CPU its twin: testing.executors)
    rope: bool = True  # "toy" only: LitGPT's attention with RoPE
    device: str = "cuda"
    lr: float = 1e-4
    return_grads: bool = False  # for bitwise comparisons
    seed: int = 0
    extra: dict = field(default_factory=dict)  # further ShardIntermediates options
    setup: str = "zero3"  # "zero3", "zero2": FSDPTransform; "ddp": thunder.distributed.ddp; "fsdp2": under ThunderFX
    checkpoint_activations: bool = False  # every block under torch.utils.checkpoint (checkpoint_blocks)


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


def _executors(cfg: RunConfig, device):
    """Thunder's benchmark's executors: TE's, the cat executor (where ``cfg.cat``), Thunder's defaults."""
    import thunder

    from thunder_fp8shard.testing.executors import benchmark_executors

    if cfg.cat:
        return benchmark_executors(device.type, transformer_engine=cfg.te, sdpa=cfg.sdpa)
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
    """One rank's jitted model, optimizer and pass (None without ``shard``)."""

    jm: object
    opt: torch.optim.Optimizer
    shard: object
    device: torch.device
    vocab_size: int  # token ids are drawn below this
    n_params: int


def setup_rank(rank: int, cfg: RunConfig) -> RankSetup:
    """Builds the model (litgpt, or the toy on the CPU), jits it with the setup, TE and the pass, and makes its AdamW
    optimizer."""
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
            model = FakeFP8Llama(cfg.n_layer, rope=cfg.rope, block_size=max(cfg.seq_len, 16), **sizes)
        vocab = model.lm_head.out_features
    else:
        from litgpt.model import GPT

        lcfg = litgpt_config(cfg)
        with device:
            model = GPT(lcfg)
        model = model.to(torch.bfloat16)
        vocab = lcfg.vocab_size
    n_params = sum(p.numel() for p in model.parameters())
    if cfg.checkpoint_activations:
        checkpoint_blocks(model)

    transforms = []
    if cfg.te:
        from thunder.executors.transformer_engineex import TransformerEngineTransform

        transforms.append(TransformerEngineTransform())
    if cfg.setup in ("zero3", "zero2"):
        transforms.append(FSDPTransform(device=device, sharding_strategy=FSDPType[cfg.setup.upper()]))
    elif cfg.setup not in ("ddp", "fsdp2"):
        raise ValueError(f"setup must be 'zero3', 'zero2', 'ddp' or 'fsdp2', got {cfg.setup!r}")
    sh = None
    if cfg.shard:
        options = {"optimizer_states": 2, **cfg.extra}  # AdamW below: two states a parameter
        sh = ShardIntermediates(method=cfg.method, prefetch=cfg.prefetch, verify=cfg.verify, **options)
        transforms.append(sh)
    if cfg.setup == "fsdp2":
        jm = _fsdp2_under_thunderfx(model, cfg, device, transforms)
    else:
        jm = thunder.jit(model, executors=_executors(cfg, device), transforms=transforms)
    if cfg.setup == "ddp":
        from thunder.distributed import ddp

        # gloo broadcasts CUDA tensors through a CPU copy written back with copy_, which autograd refuses on a leaf
        # requiring grad unless grad mode is off
        with torch.no_grad():
            jm = ddp(jm)
    opt = torch.optim.AdamW(jm.parameters(), lr=cfg.lr)
    return RankSetup(jm, opt, sh, device, vocab, n_params)


def checkpoint_blocks(model: torch.nn.Module) -> None:
    """Wraps every transformer block in non-reentrant ``checkpoint``, as Thunder's benchmark does."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    from thunder_fp8shard.testing.toy_models import LlamaBlock

    blocks: tuple[type, ...] = (LlamaBlock,)
    try:
        from litgpt.model import Block

        blocks = (*blocks, Block)
    except ImportError:  # pragma: no cover (the toy without litgpt)
        pass
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,
                                   check_fn=lambda m: isinstance(m, blocks))


def _fsdp2_under_thunderfx(model, cfg: RunConfig, device, transforms: list):
    """FSDP2 as Thunder's benchmark applies it (``fully_shard`` on every block, then the model), compiled by ThunderFX
    with the same executors and transforms."""
    import torch._dynamo
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from thunder.dynamo import ThunderCompiler

    torch._dynamo.reset()  # the other run of this process compiled the same code objects
    torch._dynamo.config.cache_size_limit = 64  # every block and grad mode is a recompile
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in (model.blocks if cfg.model == "toy" else model.transformer.h):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return torch.compile(model, backend=ThunderCompiler(executors=_executors(cfg, device), transforms=transforms))


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
            grads.append({n: _local(p.grad).detach().cpu().clone() for n, p in jm.named_parameters()
                          if p.grad is not None})
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
        # what the plan predicts: forward with the loss, and backward
        "program_peak_bytes": max(max(p["peak_forward"], p["peak_backward"]) for p in (phases[1:] or phases)),
        "saved_bytes_measured_per_step": saved, "saved_bytes_measured": saved[-1],
        "step_time_s": times, "step_time_median_s_after_first": statistics.median(times[1:] or times),
        "memory_phases_per_step": phases, "losses": losses, "losses_hex": [float(v).hex() for v in losses],
    }
    if cfg.return_grads:
        out["grads"] = grads
    if sh is not None and (t := trained(sh.plans, sh.reports)) is not None:
        # testing/trained.py's rule
        out["plans"] = len(sh.plans)
        out["runs_per_step"] = list(t.runs)
        out["sharded_total"] = t.total(lambda p: len(p.sharded))
        out["compacted_total"] = t.total(lambda p: len(p.compacted))
        # replicated copies policy "all" left out as raising the predicted peak
        out["raising_total"] = t.total(lambda p: sum(1 for d in p.decisions
                                                     if d.replicated and not d.sharded and d.reason == RAISES))
        out["predicted_saving_total"] = t.total(lambda p: p.saved_bytes_before - p.saved_bytes_after)
        plan, report = t.plan, t.report
        run_plan = report.corrected(plan)  # as the run-time audit corrected it
        out["plan"] = {
            "text": plan_text(plan, report), "saved_bytes_before": plan.saved_bytes_before, "saved_bytes_after": plan.saved_bytes_after,
            "predicted_saving": plan.saved_bytes_before - plan.saved_bytes_after,
            # the shard group's size and what each rank all-gathers in backward a step
            "shard_group_size": plan.k, "gathered_bytes_per_step": plan.gathered_bytes_per_step,
            "predicted_peak_before": getattr(plan, "peak_bytes_before", None),
            "predicted_peak_after": run_plan.peak_bytes_after,
            "compacted": len(plan.compacted), "compacted_bytes": plan.compacted_bytes_per_step,
            "audit": report.saved and asdict(report.saved),
            "calibration": report.calibration and asdict(report.calibration), "runs_per_step": report.runs_per_step,
            "operator_calls": dict(plan.operator_calls), "checks_removed": report.checks_removed,
            "compactions_in_shard_ops": sum(c.shard_op is not None for c in plan.compacted),
            "decisions": [{**asdict(d), "shape": list(d.shape), "bytes_saved": d.bytes_saved} for d in plan.decisions],
            "notes": list(plan.notes),
            # fp8_forward_gather's rows
            "forward_gather": [{**asdict(g), "shape": list(g.shape)} for g in plan.forward_gather],
            "forward_gather_bytes": list(plan.forward_gather_bytes),
            "forward_gather_calls": list(plan.forward_gather_calls),
        }
        if rank == 0:
            print(out["plan"]["text"], flush=True)
    return out


def assert_bitwise_equal_and_nonzero(without: list[dict], with_: list[dict], steps: int) -> None:
    """Two runs' ranks (without and with the pass): every loss and gradient bitwise equal, every gradient non-zero (else
    the comparison is void), and the ranks' data different."""
    for a, b in zip(without, with_):
        r = a["rank"]
        assert a["losses_hex"] == b["losses_hex"], f"rank {r}: losses differ {a['losses']} vs {b['losses']}"
        assert len(a["grads"]) == len(b["grads"]) == steps
        for step, (ga, gb) in enumerate(zip(a["grads"], b["grads"])):
            assert ga.keys() == gb.keys() and ga
            for n in ga:
                assert torch.equal(ga[n], gb[n]), f"rank {r} step {step}: gradient of {n} differs"
            zero = [n for n in ga if float(ga[n].abs().sum()) == 0]
            assert not zero, f"rank {r} step {step}: zero gradients {zero}: the comparison would be void"
    assert without[0]["losses_hex"] != without[1]["losses_hex"], "the ranks must see different data"


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a gradient (FSDP2's are DTensors)."""
    return t.to_local() if hasattr(t, "to_local") else t


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


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The litgpt model and batch shape arguments (``plan_accuracy.py``'s command line)."""
    p.add_argument("--model-name", default="Llama-2-7b-hf")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int)
    p.add_argument("--intermediate-size", type=int)
    p.add_argument("--n-head", type=int)
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=1024)
