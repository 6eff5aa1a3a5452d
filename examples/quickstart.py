"""Quick start: ShardIntermediates under Thunder FSDP ZeRO-3 on 2 CPU ranks (gloo), checked against the run without it.

Run: python examples/quickstart.py   (`make demo` runs it; without TransformerEngine Thunder warns that it is missing)
"""

import socket

import thunder
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from thunder.distributed import FSDPType
from thunder.distributed.transforms.fsdp_v2 import FSDPTransform
from torch.utils.checkpoint import checkpoint

from thunder_fp8shard import ShardIntermediates


def dequantized_linear(x, w, w_fp8, scale, w_copy):
    # the values come from the FP8 copy; the gradient goes straight through to w (w - w_copy is exactly 0)
    return F.linear(x, torch.add(w, torch.sub(torch.mul(w_fp8.to(w.dtype), scale), w_copy)))


class FP8Linear(torch.nn.Linear):
    """A linear layer that computes with a float8 copy of its weight. Recomputed in backward (checkpoint), so the
    FP8 copy is saved for backward, as TransformerEngine's linear layers save theirs."""

    def forward(self, x):
        w = self.weight
        with torch.no_grad():
            scale = torch.clamp(torch.amax(torch.abs(w)), min=1e-12) / 448.0  # 448: float8_e4m3fn's largest
            w_fp8 = torch.true_divide(w, scale).to(torch.float8_e4m3fn)
            w_copy = torch.mul(w, 1.0)
        return checkpoint(dequantized_linear, x, w, w_fp8, scale, w_copy, use_reentrant=False)


def train_step(rank, with_pass):
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), FP8Linear(256, 1024, bias=False),
                                torch.nn.GELU(), FP8Linear(1024, 64, bias=False))
    fsdp = FSDPTransform(device=torch.device("cpu"), sharding_strategy=FSDPType.ZERO3)
    shard = ShardIntermediates()  # the last transform
    jm = thunder.jit(model, transforms=[fsdp, shard] if with_pass else [fsdp])
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))  # different data on every rank
    loss = torch.mean(torch.square(jm(x)))
    loss.backward()
    return loss, [p.grad for p in jm.parameters()], shard


def worker(rank, world_size, port):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    loss0, grads0, _ = train_step(rank, with_pass=False)
    loss1, grads1, shard = train_step(rank, with_pass=True)
    plan = shard.plans[-1]
    if rank == 0:
        print(shard.describe())  # what was sharded and why not the rest; the predicted memory; the checks
    equal = torch.equal(loss0, loss1) and all(torch.equal(a, b) for a, b in zip(grads0, grads1))
    nonzero = all(torch.count_nonzero(g) > 0 for g in grads1)
    print(f"rank {rank}: saved for backward {plan.saved_bytes_before:,} -> {plan.saved_bytes_after:,} B; "
          f"loss and {len(grads1)} gradients bitwise equal: {equal}; all non-zero: {nonzero}")
    dist.destroy_process_group()
    if not (equal and nonzero):
        raise RuntimeError(f"rank {rank}: the gradients differ from the run without the pass, or are zero")


if __name__ == "__main__":
    with socket.socket() as s:  # a free port for the ranks to meet on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(2, port), nprocs=2)
