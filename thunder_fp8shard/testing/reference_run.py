"""A small data-parallel training run of a fake-FP8 model on one rank, with or without the pass, under Thunder FSDP,
Thunder DDP or FSDP2 under ThunderFX. Comparing runs with and without the pass is the exactness check of the demo and
the tests; every rank draws different inputs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from thunder_fp8shard.plan import ShardPlan
from thunder_fp8shard.runtime.run_report import RunReport
from thunder_fp8shard.testing.measure import saved_bytes


@dataclass(frozen=True)
class RunConfig:
    widths: tuple[int, ...] = (24, 64, 45, 7)
    # one optimizer step each: cache miss, new shape, cache hit; ``model="llama"``: (batch, sequence length) each
    batch_sizes: tuple = (3, 5, 3)
    rank_batch_sizes: tuple = ()  # rank r's own ``batch_sizes``, where given
    use_pass: bool = True
    options: dict = field(default_factory=dict)  # ShardIntermediates options
    rank_options: tuple[dict, ...] = ()  # rank r's options on top of ``options``
    seams: dict = field(default_factory=dict)  # for ShardIntermediates.inject
    no_grad_call: bool = True  # a forward-only call between the first and second step
    # "transform": FSDPTransform in transforms=; "fsdp", "ddp": thunder.distributed's; "fsdp2": fully_shard, then
    # torch.compile with ThunderCompiler
    api: str = "transform"
    sharding_strategy: str = "ZERO3"  # under "fsdp2": ZERO3 is reshard_after_forward=True, ZERO2 False
    compile_scope: str = "model"  # "fsdp2" only: "model" compiles the whole model, "layers" each layer
    mesh_shape: tuple[int, ...] | None = None  # "fsdp2" only: (replicate, shard) for HSDP; None: a 1-D mesh
    seed: int = 0
    # "mlp": FakeFP8MLP(widths); "checkpointed": CheckpointedBlocks; "llama": a one-block FakeFP8Llama with RoPE
    model: str = "mlp"

    def options_of(self, rank: int) -> dict:
        """The ShardIntermediates options of rank ``rank``."""
        return {**self.options, **(self.rank_options[rank] if rank < len(self.rank_options) else {})}

    def batches_of(self, rank: int) -> tuple:
        """Rank ``rank``'s batch size (or shape) each step."""
        return self.rank_batch_sizes[rank] if rank < len(self.rank_batch_sizes) else self.batch_sizes


LLAMA = dict(n_layer=1, n_embd=32, n_head=4, intermediate_size=64, vocab_size=64, rope=True, block_size=64)


def _model(cfg: RunConfig):
    from thunder_fp8shard.testing.toy_models import CheckpointedBlocks, FakeFP8Llama, FakeFP8MLP

    torch.manual_seed(cfg.seed)
    if cfg.model == "checkpointed":
        return CheckpointedBlocks(cfg.widths[0], len(cfg.widths) - 1)
    if cfg.model == "llama":
        return FakeFP8Llama(**LLAMA)
    return FakeFP8MLP(cfg.widths)


@dataclass
class RunResult:
    losses: list[torch.Tensor]
    grads: list[dict[str, torch.Tensor]]  # per step: this rank's gradient shard of every parameter
    saved_bytes: list[int]  # per step
    no_grad_output: torch.Tensor | None
    plans: list[ShardPlan]
    traces: tuple[str, str] = ("", "")  # of the first step
    step_plans: list[list[int]] = field(default_factory=list)  # per step: indices of the plans made during its forward
    reports: list[RunReport] = field(default_factory=list)  # what the run-time checks observed of each plan


def train(rank: int, world_size: int, cfg: RunConfig) -> RunResult:
    import thunder
    from thunder.distributed import FSDPType, ddp, fsdp
    from thunder.distributed.transforms.fsdp_v2 import FSDPTransform

    from thunder_fp8shard import ShardIntermediates

    if cfg.api == "fsdp2":
        return train_fsdp2(rank, world_size, cfg)
    model = _model(cfg)
    shard = ShardIntermediates(**cfg.options_of(rank)).inject(**cfg.seams)
    extra = [shard] if cfg.use_pass else []
    strategy = FSDPType[cfg.sharding_strategy]
    if cfg.api == "transform":
        fsdp_t = FSDPTransform(device=torch.device("cpu"), sharding_strategy=strategy)
        jm = thunder.jit(model, transforms=[fsdp_t, *extra])
    elif cfg.api == "fsdp":
        jm = fsdp(thunder.jit(model, transforms=extra), device=torch.device("cpu"), sharding_strategy=strategy)
    else:
        jm = ddp(thunder.jit(model, transforms=extra))
    opt = torch.optim.SGD(jm.parameters(), lr=0.1)

    result = RunResult([], [], [], None, [])
    for step, batch in enumerate(cfg.batches_of(rank)):
        gen, x, target = _batch(rank, step, batch, cfg.widths)
        with saved_bytes() as saved:
            out = jm(x)
        loss = torch.nn.functional.mse_loss(out, target)
        opt.zero_grad()
        loss.backward()
        result.losses.append(loss.detach().clone())
        result.grads.append({n: p.grad.detach().clone() for n, p in jm.named_parameters()})
        if x.grad is not None:
            result.grads[-1]["input"] = x.grad.detach().clone()
        result.saved_bytes.append(saved.total)
        opt.step()
        if step == 0:
            entry = thunder.compile_stats(jm).interpreter_cache[0]
            result.traces = (str(entry.computation_traces[-1]), str(entry.backward_traces[-1]))
        if step == 0 and cfg.no_grad_call:
            with torch.no_grad():
                result.no_grad_output = jm(torch.randn(2, cfg.widths[0], generator=gen))
    result.plans, result.reports = list(shard.plans), list(shard.reports)
    return result


def train_fsdp2(rank: int, world_size: int, cfg: RunConfig) -> RunResult:
    """FSDP2 (``fully_shard`` on every layer and the model) compiled by ThunderFX with the pass; gradients are this
    rank's local shards of FSDP2's gradients."""
    import torch._dynamo
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from thunder.dynamo import ThunderCompiler

    from thunder_fp8shard import ShardIntermediates
    torch._dynamo.reset()  # the other run of this process compiled the same code objects
    # every layer, grad mode and shape kind is its own Dynamo graph of one code object
    torch._dynamo.config.cache_size_limit = 64
    model = _model(cfg)
    shard = ShardIntermediates(**cfg.options_of(rank)).inject(**cfg.seams)
    backend = ThunderCompiler(transforms=[shard] if cfg.use_pass else [])
    if cfg.mesh_shape is None:
        mesh = init_device_mesh("cpu", (world_size,))
    else:
        mesh = init_device_mesh("cpu", cfg.mesh_shape, mesh_dim_names=("replicate", "shard")[-len(cfg.mesh_shape):])
    reshard = {"ZERO3": True, "ZERO2": False}[cfg.sharding_strategy]
    for layer in model.blocks if cfg.model == "llama" else model.layers:
        if cfg.compile_scope == "layers":
            layer.compile(backend=backend)
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    run = torch.compile(model, backend=backend) if cfg.compile_scope == "model" else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    result = RunResult([], [], [], None, [])
    for step, batch in enumerate(cfg.batches_of(rank)):
        gen, x, target = _batch(rank, step, batch, cfg.widths)
        first = len(shard.plans)
        with saved_bytes() as saved:
            out = run(x)
        result.step_plans.append(list(range(first, len(shard.plans))))
        loss = torch.nn.functional.mse_loss(out, target)
        opt.zero_grad()
        loss.backward()
        result.losses.append(loss.detach().clone())
        result.grads.append({n: p.grad.to_local().detach().clone() for n, p in model.named_parameters()})
        if x.grad is not None:
            result.grads[-1]["input"] = x.grad.detach().clone()
        result.saved_bytes.append(saved.total)
        opt.step()
        if step == 0 and cfg.no_grad_call:
            with torch.no_grad():
                result.no_grad_output = run(torch.randn(2, cfg.widths[0], generator=gen))
    result.plans, result.reports = list(shard.plans), list(shard.reports)
    return result


def _batch(rank: int, step: int, batch, widths: tuple[int, ...]):
    """This rank's data for one step, and the generator for anything drawn after it."""
    gen = torch.Generator().manual_seed(1000 * rank + step)
    if isinstance(batch, tuple):
        idx = torch.randint(0, LLAMA["vocab_size"], batch, generator=gen)
        return gen, idx, torch.randn(*batch, LLAMA["vocab_size"], generator=gen)
    x = torch.randn(batch, widths[0], generator=gen, requires_grad=True)
    return gen, x, torch.randn(batch, widths[-1], generator=gen)


def train_with_and_without(rank: int, world_size: int, cfg: RunConfig) -> tuple[RunResult, RunResult]:
    """The same run without the pass, then with it, in one process."""
    from dataclasses import replace

    return train(rank, world_size, replace(cfg, use_pass=False)), train(rank, world_size, replace(cfg, use_pass=True))


def mismatches(baseline: RunResult, candidate: RunResult) -> list[str]:
    """What differs bit-wise between two runs of one rank (losses, every gradient, the no-grad output)."""
    bad = [f"loss of step {i}" for i, (a, b) in enumerate(zip(baseline.losses, candidate.losses)) if not torch.equal(a, b)]
    for i, (ga, gb) in enumerate(zip(baseline.grads, candidate.grads)):
        bad += [f"grad {n} of step {i}" for n in ga if not torch.equal(ga[n], gb[n])]
    if baseline.no_grad_output is not None and not torch.equal(baseline.no_grad_output, candidate.no_grad_output):
        bad.append("no-grad output")
    return bad
