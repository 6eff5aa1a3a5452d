"""Small generated models for the property test, run on one rank with and without the pass. The step's peak is the
profiler's CPU allocation events replayed (:func:`~thunder_fp8shard.testing.measure.cpu_peak`): exact for what the step
allocates, and what it leaves out is the same in both runs."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from thunder_fp8shard.testing.measure import cpu_peak, saved_bytes
from thunder_fp8shard.testing.toy_models import FP8WeightLinear, fake_fp8_linear

LAYERS = ("linear", "layer_norm", "expand", "view", "fp8", "shared")  # drawn; "checkpoint", "tied_fp8" where named
# a tensor a collective's thread frees a moment late can overlap one step's peak (seen in 1 of 12 runs of 4 steps);
# the lowest of a few steps is the step's own
PEAK_STEPS = 8


@dataclass(frozen=True)
class Case:
    seed: int
    setup: str  # "ZERO3", "ZERO2", "DDP" or "FSDP2" (fully_shard on the model, compiled by ThunderFX)
    layers: tuple[str, ...]
    candidates: tuple[str, ...] = ("fp8", "all")  # one run with the pass for each, against one without
    d: int = 32
    batch: tuple[int, int] = (2, 4)

    @classmethod
    def draw(cls, seed: int, setup: str, n_layers: int = 4) -> Case:
        rng = random.Random(seed)
        # something for each kind of candidate, a weight used through a view, an expand or again, then a random mix
        layers = ["fp8", "linear", rng.choice(("expand", "view", "shared"))]
        layers += [rng.choice(LAYERS) for _ in range(n_layers - 3)]
        rng.shuffle(layers)
        return cls(seed, setup, tuple(layers))


class _Layer(nn.Module):
    """The parameters a layer uses, and no other (Thunder FSDP leaves a parameter the program never uses unsharded in
    the prologue's check)."""

    def __init__(self, d: int, weight: bool, vector: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d) / d ** 0.5) if weight else None
        self.vector = nn.Parameter(1 + 0.1 * torch.randn(d)) if vector else None


class Generated(nn.Module):
    """``case.layers`` in order, a ``tanh`` after each: ``linear``, ``layer_norm``, ``expand``, ``view`` (a weight
    reshaped), ``fp8`` (:class:`FP8WeightLinear`), ``shared`` (the first linear weight again), ``checkpoint`` (a
    linear and a relu recomputed in the backward), ``tied_fp8`` (the first linear weight again, as a checkpointed FP8
    copy: an embedding tied to an FP8 head)."""

    def __init__(self, case: Case):
        super().__init__()
        d = case.d
        self.kinds = case.layers
        # ThunderFX (torch 2.11's autograd_function_apply) takes no autograd.Function: FP8 copies by checkpoint there
        self.fp8_by_checkpoint = case.setup == "FSDP2"
        layers, linear_before = [], False
        for kind in case.layers:
            tied = kind in ("shared", "tied_fp8")
            own_weight = kind in ("linear", "view", "fp8", "checkpoint") or (tied and not linear_before)
            layers.append(_Layer(d, own_weight, kind in ("linear", "layer_norm", "expand")))
            linear_before = linear_before or kind == "linear"
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = None
        for kind, layer in zip(self.kinds, self.layers):
            w, v = layer.weight, layer.vector
            if kind == "linear":
                x = F.linear(x, w, v)
                first = w if first is None else first
            elif kind == "layer_norm":
                x = F.layer_norm(x, (x.shape[-1],), v, None, 1e-5)
            elif kind == "expand":
                x = torch.mul(x, v.expand(x.shape))
            elif kind == "view":
                x = F.linear(x, torch.reshape(torch.reshape(w, (-1,)), w.shape))
            elif kind == "fp8":
                x = fake_fp8_linear(x, w, None) if self.fp8_by_checkpoint else FP8WeightLinear.apply(x, w)
            elif kind == "checkpoint":
                x = checkpoint(_relu_linear, x, w, use_reentrant=False)
            elif kind == "tied_fp8":
                x = fake_fp8_linear(x, first if first is not None else w, None)
            else:  # "shared"
                x = F.linear(x, first if first is not None else w)
            x = torch.tanh(x)
        return x


def _relu_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.relu(F.linear(x, w))


def compiled(world_size: int, case: Case, candidates: str | None):
    """``case``'s model (seeded: the same weights on every rank) under its setup, without the pass (``candidates``
    None) or with it as the last transform; and the pass."""
    import thunder
    from thunder.distributed import FSDPType, ddp
    from thunder.distributed.transforms.fsdp_v2 import FSDPTransform

    from thunder_fp8shard import ShardIntermediates

    torch.manual_seed(case.seed)
    model = Generated(case)
    shard = ShardIntermediates(candidates=candidates or "fp8", min_bytes=512)
    extra = [shard] if candidates else []
    if case.setup == "DDP":
        return ddp(thunder.jit(model, transforms=extra)), shard
    if case.setup == "FSDP2":
        return _fsdp2(model, world_size, extra), shard
    fsdp = FSDPTransform(device=torch.device("cpu"), sharding_strategy=FSDPType[case.setup])
    return thunder.jit(model, transforms=[fsdp, *extra]), shard


def run_case(rank: int, world_size: int, case: Case) -> dict:
    """One rank's runs of ``case`` without the pass (key None) and with it for each of ``case.candidates``: gradients,
    saved bytes, the lowest peak of :data:`PEAK_STEPS` steps, and the plans (none without the pass)."""
    out = {}
    for candidates in (None, *case.candidates):  # None: without the pass
        jm, shard = compiled(world_size, case, candidates)
        gen = torch.Generator().manual_seed(1000 * rank + case.seed)
        x = torch.randn(*case.batch, case.d, generator=gen, requires_grad=True)
        target = torch.randn(*case.batch, case.d, generator=gen)
        F.mse_loss(jm(x), target).backward()  # compiles
        peaks = []
        for _ in range(PEAK_STEPS):  # after the compiling step; the first includes the pass's calibration
            for p in (*jm.parameters(), x):
                p.grad = None
            with cpu_peak() as peak:
                with saved_bytes() as saved:
                    y = jm(x)
                loss = F.mse_loss(y, target)
                del y
                loss.backward()
                del loss
            peaks.append(peak.bytes)
        grads = {n: _local(p.grad).detach().clone() for n, p in jm.named_parameters()}
        grads["input"] = x.grad.detach().clone()
        out[candidates] = dict(grads=grads, saved=saved.total, peak=min(peaks), plans=list(shard.plans))
    return out


def plans_with_accumulation(rank: int, world_size: int, case: Case, micro_batches: int = 2) -> dict:
    """One rank's plans of ``case`` with each of ``case.candidates`` over a step of ``micro_batches`` micro-batches,
    the gradients accumulated, every one but the last without the gradients' reduction
    (``skip_data_parallel_grad_sync``)."""
    return {c: accumulated(rank, world_size, case, c, micro_batches)[1] for c in case.candidates}


def accumulated(rank: int, world_size: int, case: Case, candidates: str | None, micro_batches: int = 2,
                steps: int = 1):
    """``steps`` steps of ``micro_batches`` micro-batches of ``case`` (every one but each step's last under
    ``skip_data_parallel_grad_sync``), without the pass (``candidates`` None) or with it: the accumulated gradients,
    the pass's plans and the losses."""
    import contextlib

    from thunder.distributed import skip_data_parallel_grad_sync

    jm, shard = compiled(world_size, case, candidates)
    gen = torch.Generator().manual_seed(1000 * rank + case.seed)
    losses = []
    for _ in range(steps):
        for p in jm.parameters():
            p.grad = None
        for micro in range(micro_batches):
            x = torch.randn(*case.batch, case.d, generator=gen, requires_grad=True)
            with contextlib.nullcontext() if micro == micro_batches - 1 else skip_data_parallel_grad_sync():
                loss = F.mse_loss(jm(x), torch.zeros_like(x))
                loss.backward()
                losses.append(loss.detach())
    grads = {n: _local(p.grad).detach().clone() for n, p in jm.named_parameters()}
    return grads, list(shard.plans), losses


def with_and_without_accumulation(rank: int, world_size: int, case: Case, micro_batches: int = 3) -> dict:
    """:func:`accumulated` without the pass and with ``case.candidates[0]``, two steps."""
    return {c: accumulated(rank, world_size, case, c, micro_batches, steps=2) for c in (None, case.candidates[0])}


def _fsdp2(model: nn.Module, world_size: int, transforms: list):
    """``fully_shard`` on the whole model (a weight shared between layers stays in one unit), compiled by ThunderFX."""
    import torch._dynamo
    from thunder.dynamo import ThunderCompiler
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch._dynamo.reset()  # the other runs of this process compiled the same code objects
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    return torch.compile(model, backend=ThunderCompiler(transforms=transforms))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's (FSDP2's gradient) local shard; a tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t
