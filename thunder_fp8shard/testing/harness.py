"""Runs a function on N real processes on this machine (gloo, or NCCL with one GPU a rank) and collects what each
rank returns; or on one simulated rank of N (torch's fake process group).

Used by the demo, the tests and the notebooks; it is not part of the pass.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_on_ranks(
    fn: Callable[..., Any], world_size: int, *args, timeout_s: float = 600, backend: str = "gloo"
) -> list[Any]:
    """``[fn(rank, world_size, *args) for rank in range(world_size)]``, each rank in its own process. With
    ``backend="nccl"`` rank r uses GPU r (``LOCAL_RANK`` is the rank).

    ``fn`` must be importable (module level) and return picklable data. An exception on any rank is re-raised here
    with that rank's traceback.
    """
    return _run(fn, world_size, tuple(range(world_size)), args, timeout_s, backend)


def run_simulated(fn: Callable[..., Any], world_size: int, *args, rank: int = 0, timeout_s: float = 600) -> Any:
    """``fn(rank, world_size, *args)`` in a process of its own that joins torch's fake process group as rank ``rank``
    of ``world_size`` (``init_process_group("fake", store=FakeStore(), ...)``): collectives return at once and move
    nothing, so values are meaningless, but shapes, process groups (``new_group`` works), plans and memory are those
    of that rank of a real run. How the benchmarks simulate rank 0 of N on one device."""
    return _run(fn, world_size, (rank,), args, timeout_s, "fake")[0]


def _run(fn, world_size: int, ranks: tuple[int, ...], args, timeout_s: float, backend: str) -> list[Any]:
    port = _free_port()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, port, results, args, backend)) for r in ranks]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    try:
        for _ in procs:
            try:
                rank, ok, value = results.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"no result from ranks {sorted(set(ranks) - set(out))} in {timeout_s} s") from None
            if not ok:  # the other ranks may be stuck in a collective waiting for this one: stop them all
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=5 if len(out) == len(ranks) else 0)
            if p.is_alive():
                p.kill()
    return [out[r] for r in ranks]


def _rank_main(fn, rank, world_size, port, results, args, backend):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        if backend == "fake":
            from torch.testing._internal.distributed.fake_pg import FakeStore

            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        else:
            dist.init_process_group(backend, rank=rank, world_size=world_size)
        value = fn(rank, world_size, *args)
        results.put((rank, True, pickle.dumps(value)))  # plain bytes: no shared-memory tensors to outlive us
    except BaseException:  # report every failure to the parent instead of hanging it
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
