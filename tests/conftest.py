import os
import socket

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(scope="session")
def single_rank_group():
    """An in-process gloo group of size 1, so Thunder's FSDP can trace its all-gathers for pass-level tests."""
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("LOCAL_RANK", "0")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def fsdp_traces(single_rank_group):
    """Forward and backward traces (and the FSDP group) of the fake-FP8 MLP under Thunder FSDP ZeRO-3, no pass."""
    import thunder
    from thunder.distributed import FSDPType
    from thunder.distributed.transforms.fsdp_v2 import FSDPTransform

    from thunder_fp8shard.testing.toy_models import FakeFP8MLP

    torch.manual_seed(0)
    jm = thunder.jit(FakeFP8MLP(), transforms=[FSDPTransform(device=torch.device("cpu"), sharding_strategy=FSDPType.ZERO3)])
    jm(torch.randn(3, 24, requires_grad=True)).sum().backward()
    entry = thunder.compile_stats(jm).interpreter_cache[0]
    group = thunder.compile_data(jm).process_group_for_ddp
    return entry.computation_traces[-1], entry.backward_traces[-1], group
