"""Quick start: ShardIntermediates under Thunder FSDP ZeRO-3 on 2 CPU ranks. Run: python examples/quickstart.py"""

import socket
import warnings

warnings.filterwarnings("ignore", message="transformer_engine module not found")  # before thunder; no TE on a CPU

import thunder
import torch
import torch.distributed as dist
import torch.nn.functional as F
from thunder.distributed import FSDPType
from thunder.distributed.transforms.fsdp_v2 import FSDPTransform

from thunder_fp8shard import ShardIntermediates
from thunder_fp8shard.testing.measure import cpu_peak
from thunder_fp8shard.testing.toy_models import FP8WeightLinear

fp8_linear = FP8WeightLinear.apply  # x @ w.T with a float8 copy of w, saved for backward (docs/fp8_copies.md)


class Block(torch.nn.Module):  # x + attention(norm(x)), then x + MLP(norm(x))
    def __init__(self, d=256, heads=4):
        super().__init__()
        self.heads, self.norm1, self.norm2 = heads, torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d, bias=False), torch.nn.Linear(d, d, bias=False)
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d, bias=False), torch.nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        qkv = fp8_linear(self.norm1(x), self.qkv.weight).reshape(b, t, 3, self.heads, -1).transpose(1, 3)
        y = F.scaled_dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True)
        x = x + fp8_linear(y.transpose(1, 2).reshape(b, t, d), self.proj.weight)
        return x + fp8_linear(F.gelu(fp8_linear(self.norm2(x), self.fc1.weight)), self.fc2.weight)


def train(rank, with_pass):
    torch.manual_seed(0)  # the same initial weights on every rank
    shard = ShardIntermediates(optimizer_states=0)  # the last transform; no optimizer here
    fsdp = FSDPTransform(device=torch.device("cpu"), sharding_strategy=FSDPType.ZERO3)
    jm = thunder.jit(torch.nn.Sequential(Block(), Block()), transforms=[fsdp, shard] if with_pass else [fsdp])
    x = torch.randn(4, 64, 256, generator=torch.Generator().manual_seed(rank))  # different data on every rank
    peaks = []
    for _ in range(4):  # the first step compiles, the next two run the pass's first-call checks
        jm.zero_grad(set_to_none=True)
        with cpu_peak() as peak:  # the most bytes the CPU allocator held (the profiler's events)
            loss = torch.mean(torch.square(jm(x)))
            loss.backward()
        peaks.append(peak.bytes)
    return loss, [p.grad for p in jm.parameters()], min(peaks[1:]), shard.plans[-1] if with_pass else None


def worker(rank, port):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    loss0, grads0, measured0, _ = train(rank, with_pass=False)
    loss1, grads1, measured1, plan = train(rank, with_pass=True)  # shard.describe(): the whole plan, and why
    exact = [None, None]
    dist.all_gather_object(exact, torch.equal(loss0, loss1) and all(
        torch.equal(a, b) and torch.count_nonzero(b) > 0 for a, b in zip(grads0, grads1)))
    if rank == 0:
        print(f"sharded {len(plan.sharded)} of {len(plan.decisions)} candidates (FP8 weight copies); rank 0's peak:")
        for what, before, after in (("predicted", plan.peak_bytes_before, plan.peak_bytes_after),
                                    ("measured ", measured0, measured1)):
            print(f"  {what} {before / 2**20:.2f} MiB -> {after / 2**20:.2f} MiB (-{1 - after / before:.1%})")
        print(f"loss and {len(grads1)} gradients bitwise those without the pass, and non-zero, on ranks 0, 1: {exact}")
    dist.destroy_process_group()
    assert all(exact), "the gradients differ from the run without the pass, or are zero"


if __name__ == "__main__":
    with socket.socket() as s:  # a free port for the ranks to meet on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(worker, args=(port,), nprocs=2)
