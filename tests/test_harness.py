"""The test harness's rank pool (thunder_fp8shard.testing.harness.RankPool): processes started once and reused, each
function given what a fresh process would have, and a failing, dying or hanging rank neither hangs the caller nor
leaves broken workers behind. The failure cases run on a pool of their own (the session's stays as it is)."""

from __future__ import annotations

import os
import time

import pytest
import torch

from thunder_fp8shard.testing.harness import RankPool

pytestmark = pytest.mark.multirank


def _plant_state(rank, world_size):
    """Changes what the next function must not see: an environment variable, a module global of the pass, the
    random state, grad mode. Returns this process's id and its first random draw."""
    import torch.distributed as dist

    import thunder_fp8shard.pipeline as analysis

    first = torch.rand(3)
    os.environ["FP8SHARD_PLANTED"] = str(rank)
    analysis.analyze_replication = "planted"  # a module global of the pass, rebound
    torch.set_grad_enabled(False)
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    return os.getpid(), first, float(total)


def _read_state(rank, world_size):
    import thunder_fp8shard.pipeline as analysis
    from thunder_fp8shard.analysis.replication import analyze_replication

    return (os.getpid(), torch.rand(3), os.environ.get("FP8SHARD_PLANTED"),
            analysis.analyze_replication is analyze_replication, torch.is_grad_enabled())


def test_the_pool_reuses_its_processes_and_each_function_finds_a_fresh_state(on_ranks):
    planted = on_ranks(_plant_state, 2)
    assert [total for _, _, total in planted] == [3.0, 3.0]  # a collective over both ranks
    later = on_ranks(_read_state, 2)
    for (pid, first, _), (pid_later, draw, env, seam_undone, grad) in zip(planted, later):
        assert pid_later == pid != os.getpid()  # the same worker
        assert torch.equal(draw, first)  # the random state as the process started
        assert env is None and seam_undone and grad


def _raise_on_rank_1_while_rank_0_waits(rank, world_size):
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("planted failure on rank 1")
    dist.all_reduce(torch.zeros(1))  # never matched: rank 1 raised
    return os.getpid()


def _pid(rank, world_size):
    return os.getpid()


def _sleep_on_rank_0(rank, world_size, seconds):
    if rank == 0:
        time.sleep(seconds)
    return os.getpid()


def _exit_on_rank_1(rank, world_size):
    if rank == 1:
        os._exit(3)
    time.sleep(5)  # rank 0 would see the closed connection in the barrier after the function: the death comes first
    return os.getpid()


def _dead(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _wait_dead(pids, timeout_s=10):
    deadline = time.monotonic() + timeout_s
    while not all(_dead(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return all(_dead(p) for p in pids)


def test_a_failing_rank_raises_with_its_traceback_and_the_workers_are_replaced():
    """Rank 1 raises while rank 0 waits in an all-reduce that will never complete: the caller gets rank 1's error at
    once, with its traceback, the workers are killed, and the next call runs on new ones."""
    pool = RankPool(2)
    try:
        pids = pool.run(_pid, timeout_s=300)
        assert pool.run(_pid) == pids  # reused
        with pytest.raises(RuntimeError, match=r"(?s)rank 1 failed:\n.*_raise_on_rank_1_while_rank_0_waits.*"
                                               r"ValueError: planted failure on rank 1"):
            pool.run(_raise_on_rank_1_while_rank_0_waits, timeout_s=300)
        assert _wait_dead(pids) and not pool.alive
        new = pool.run(_pid, timeout_s=300)
        assert set(new).isdisjoint(pids) and pool.starts == 2
        # a rank that hangs: no result in the timeout (rank 1 waits in the barrier after the function for rank 0),
        # the workers are killed
        with pytest.raises(TimeoutError, match=r"no result from ranks \[0, 1\] in 2 s"):
            pool.run(_sleep_on_rank_0, 600, timeout_s=2)
        assert _wait_dead(new) and not pool.alive
        # a rank that dies without a word
        last = pool.run(_pid, timeout_s=300)
        with pytest.raises(RuntimeError, match=r"rank 1 exited \(code 3\) without a result"):
            pool.run(_exit_on_rank_1, timeout_s=300)
        assert _wait_dead(last) and not pool.alive and pool.starts == 3
    finally:
        pool.close()
    assert not pool.alive


def test_an_unpicklable_function_raises_in_the_caller_and_keeps_the_workers(on_ranks, rank_pools):
    before = on_ranks(_pid, 2)
    with pytest.raises(Exception, match=r"(?i)pickle"):
        on_ranks(lambda rank, world_size: rank, 2)
    assert on_ranks(_pid, 2) == before
