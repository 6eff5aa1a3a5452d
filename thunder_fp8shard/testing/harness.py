"""Runs a function on N processes (gloo, or NCCL one GPU a rank) and collects what each rank returns, or on one
simulated rank of N (torch's fake process group). :func:`run_on_ranks` starts processes for each call; a
:class:`RankPool` keeps them for many calls."""

from __future__ import annotations

import atexit
import gc
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_on_ranks(
    fn: Callable[..., Any], world_size: int, *args, timeout_s: float = 600, backend: str = "gloo"
) -> list[Any]:
    """``[fn(rank, world_size, *args) for rank in range(world_size)]``, each rank in its own process; ``fn`` must be
    importable and return picklable data."""
    return _run(fn, world_size, tuple(range(world_size)), args, timeout_s, backend)


def run_simulated(fn: Callable[..., Any], world_size: int, *args, rank: int = 0, timeout_s: float = 600) -> Any:
    """``fn(rank, world_size, *args)`` as rank ``rank`` of torch's fake process group: collectives move nothing, but
    shapes, plans and memory are that rank's in a real run."""
    return _run(fn, world_size, (rank,), args, timeout_s, "fake")[0]


def _run(fn, world_size: int, ranks: tuple[int, ...], args, timeout_s: float, backend: str, tries: int = 3
         ) -> list[Any]:
    """``fn`` on ``ranks``, started again where another process took the chosen port first (EADDRINUSE)."""
    for attempt in range(tries):
        try:
            return _run_once(fn, world_size, ranks, args, timeout_s, backend)
        except RuntimeError as e:
            if "EADDRINUSE" not in str(e) or attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


def _run_once(fn, world_size: int, ranks: tuple[int, ...], args, timeout_s: float, backend: str) -> list[Any]:
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
    except BaseException:  # report every failure instead of hanging the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class RankPool:
    """``world_size`` gloo processes, forked once from a server that imported everything, running function after
    function. Every rank runs every function in order, and a barrier checks each came back; between functions a worker
    restores what a fresh process would have (environment, random states, Dynamo, ``thunder_fp8shard`` globals a test
    rebound). A failure kills the workers (others may wait in a collective) and raises that rank's error."""

    def __init__(self, world_size: int, backend: str = "gloo"):
        if backend != "gloo":
            raise ValueError(f"RankPool runs gloo ranks only, got backend={backend!r}; use run_on_ranks")
        self.world_size, self.backend = world_size, backend
        self.starts = 0  # 1 + the discards followed by a call
        self.calls = 0
        self._procs: list = []
        self._tasks: list = []
        self._results = None
        self._store = None
        atexit.register(self.close)

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable[..., Any], *args, timeout_s: float = 600) -> list[Any]:
        """``run_on_ranks`` on the pool's workers, started if needed."""
        # here, not in a queue's feeder thread, so a pickling error raises in the caller
        task = pickle.dumps((fn, args))
        if not self.alive:
            self._start()
        self.calls += 1
        for q in self._tasks:
            q.put((self.calls, task))
        out: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(out) < self.world_size:
                try:
                    call, rank, ok, value = self._results.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
                except queue.Empty:
                    dead = [(r, p.exitcode) for r, p in enumerate(self._procs) if not p.is_alive() and r not in out]
                    if dead:
                        raise RuntimeError(f"rank {dead[0][0]} exited (code {dead[0][1]}) without a result") from None
                    if time.monotonic() >= deadline:
                        raise TimeoutError(f"no result from ranks {sorted(set(range(self.world_size)) - set(out))} in "
                                           f"{timeout_s} s") from None
                    continue
                if not ok:  # the other ranks may wait in a collective for this one
                    raise RuntimeError(f"rank {rank} failed{' to start' if call is None else ''}:\n{value}")
                out[rank] = pickle.loads(value)
        except BaseException:
            self.discard()
            raise
        return [out[r] for r in range(self.world_size)]

    def _start(self) -> None:
        self.discard()
        ctx = _pool_context()
        # the store is served from here on a port the kernel picks and this process holds, so no other pool can take it
        # between choice and use
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        port = self._store.port
        self._results = ctx.Queue()
        self._tasks = [ctx.SimpleQueue() for _ in range(self.world_size)]
        self._procs = [ctx.Process(target=_pool_main, args=(r, self.world_size, port, self._tasks[r], self._results),
                                   name=f"RankPool-{self.world_size}-rank{r}") for r in range(self.world_size)]
        for p in self._procs:
            p.start()
        self.starts += 1

    def discard(self) -> None:
        """Kills the workers (a later call starts new ones)."""
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=10)
        self._procs, self._tasks = [], []
        if self._results is not None:
            self._results.close()
            self._results.cancel_join_thread()
            self._results = None
        self._store = None

    def close(self, timeout_s: float = 10) -> None:
        """Stops the workers: each leaves the process group and exits (killed if it does not in ``timeout_s``)."""
        if self.alive:
            for q in self._tasks:
                q.put(None)
            deadline = time.monotonic() + timeout_s
            for p in self._procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        self.discard()


class RankPools:
    """One :class:`RankPool` a world size; at most ``max_workers`` processes, closing the least recently used first."""

    def __init__(self, max_workers: int | None = None):
        self.max_workers = max_workers
        self.pools: dict[int, RankPool] = {}  # in order of last use

    def run(self, fn: Callable[..., Any], world_size: int, *args, timeout_s: float = 600) -> list[Any]:
        pool = self.pools.pop(world_size, None) or RankPool(world_size)
        self.pools[world_size] = pool
        if self.max_workers is not None and not pool.alive:
            for other in list(self.pools.values())[:-1]:
                if sum(p.world_size for p in self.pools.values() if p.alive) + world_size <= self.max_workers:
                    break
                other.close()
        return pool.run(fn, *args, timeout_s=timeout_s)

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()


# what the fork server imports once, before forking any worker
POOL_PRELOAD = ["thunder_fp8shard.testing.harness", "thunder_fp8shard.testing.reference_run",
                "thunder_fp8shard.testing.litgpt_run"]


def _pool_context():
    """Forks workers from a server that imported torch, Thunder and the pass once; spawns where there is none."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(POOL_PRELOAD)
    return ctx


def start_pool_server() -> None:
    """Starts the fork server now, so the first pool does not wait; the ``sys.path`` of this moment is the workers'."""
    ctx = _pool_context()
    if ctx.get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


class _FreshState:
    """What a worker puts back after each function: the state when its process group was initialized."""

    PACKAGE = "thunder_fp8shard"

    def __init__(self):
        import random

        # import the test support before the first function too, so a seam planted in it is undone as well
        import thunder_fp8shard.testing.litgpt_run  # noqa: F401
        import thunder_fp8shard.testing.reference_run  # noqa: F401

        self.environ = dict(os.environ)
        self.torch_rng = torch.get_rng_state()
        self.random = random.getstate()
        self.dtype = torch.get_default_dtype()
        self.threads = torch.get_num_threads()
        self.dynamo_config = self._dynamo_config()

    @staticmethod
    def _dynamo_config():
        import torch._dynamo

        return torch._dynamo.config.save_config()

    def globals_before(self) -> dict[str, dict[str, Any]]:
        return {name: dict(vars(m)) for name, m in list(sys.modules.items())
                if m is not None and (name == self.PACKAGE or name.startswith(self.PACKAGE + "."))}

    def restore(self, globals_before: dict[str, dict[str, Any]]) -> None:
        import random

        import torch._dynamo

        for name, before in globals_before.items():  # rebound or deleted globals only: new names may be submodules
            now = vars(sys.modules[name])
            for k, v in before.items():
                if now.get(k, _MISSING) is not v:
                    now[k] = v
        if dict(os.environ) != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        torch.set_rng_state(self.torch_rng)
        random.setstate(self.random)
        torch.set_grad_enabled(True)
        torch.set_default_dtype(self.dtype)
        torch.set_num_threads(self.threads)
        torch._dynamo.reset()
        torch._dynamo.config.load_config(self.dynamo_config)


_MISSING = object()


def _pool_main(rank, world_size, port, tasks, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False)  # the pool's (RankPool._start)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        fresh = _FreshState()
        gc.collect()
        gc.freeze()  # what is imported stays: the collector skips it
    except BaseException:
        results.put((None, rank, False, traceback.format_exc()))
        return
    while (item := tasks.get()) is not None:
        call, task = item
        globals_before = fresh.globals_before()
        try:
            fn, args = pickle.loads(task)
            value = pickle.dumps(fn(rank, world_size, *args))
            dist.barrier()  # every rank came back: no collective left unmatched
            results.put((call, rank, True, value))
        except BaseException:  # reported; then this worker waits to be killed
            results.put((call, rank, False, traceback.format_exc()))
        finally:
            fresh.restore(globals_before)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter's slow teardown of torch and Thunder


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
