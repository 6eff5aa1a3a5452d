import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

# a torch.compile region the pass cannot replay fails the test instead of a warning (thunder_fp8shard.analysis.aliasing); set
# before the rank pool's fork server starts, so its workers have it too
os.environ.setdefault("THUNDER_FP8SHARD_STRICT_REPLAY", "1")
# the processes the tests start (ranks, notebook kernels) import Thunder, which warns that TransformerEngine is missing
# (pyproject's filterwarnings is this process's)
os.environ.setdefault("PYTHONWARNINGS", "ignore:transformer_engine module not found")


@pytest.fixture(scope="session")
def single_rank_group():
    """An in-process gloo group of size 1, so Thunder's FSDP can trace its all-gathers for pass-level tests."""
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    os.environ.setdefault("LOCAL_RANK", "0")
    # an in-memory store: no TCP port to pick (none to collide with the rank pool's, or another xdist worker's)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
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


# ---- the gloo ranks of the multi-rank tests --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def rank_pools():
    """The session's gloo worker processes, one :class:`~thunder_fp8shard.testing.harness.RankPool` a world size,
    started on first use and stopped at the end: ``rank_pools.run(fn, world_size, *args)`` is ``run_on_ranks``
    without a process start. A rank's failure discards that size's workers (the next call starts new ones)."""
    from thunder_fp8shard.testing.harness import RankPools

    pools = RankPools()
    yield pools
    pools.close()


@pytest.fixture
def on_ranks(rank_pools):
    """``on_ranks(fn, world_size, *args, timeout_s=600)``: as ``run_on_ranks``, on the session's gloo workers."""
    return rank_pools.run


# ---- tiers -----------------------------------------------------------------------------------------------------------

TIERS = ("multirank", "simulated", "gpu", "notebook")  # registered in pyproject.toml; everything else is "unit"
POOL_FIXTURES = {"rank_pools", "on_ranks"}


ORDER = ("unit", "simulated", "multirank", "gpu", "notebook")
# under pytest-xdist: the single-process notebook and simulated ranks first (the other worker's ranks keep the other
# core busy meanwhile), the multi-rank tests (most of the CPU, each on several processes) next, the in-process tests
# last, many and short, to fill the workers' ends
XDIST_ORDER = ("notebook", "simulated", "multirank", "unit", "gpu")


def _tier(item) -> str:
    return next(t for t in ORDER if item.get_closest_marker(t))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Every item gets its tier: nbmake's notebooks ``notebook``, tests without another tier ``unit`` (select with
    ``-m unit``, ``-m "not multirank"``, ...); a test on the session's gloo workers must be marked ``multirank``.
    The tiers run in ``ORDER`` (within one, in the order collected): the in-process tests first, while the rank pool's
    fork server imports torch and Thunder on the other core. In a pytest-xdist worker in ``XDIST_ORDER``: the order
    the scheduler (``pytest_xdist_make_scheduler``) hands the tests out in."""
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.notebook)
        tiers = [t for t in TIERS if item.get_closest_marker(t)]
        if POOL_FIXTURES & set(getattr(item, "fixturenames", ())) and "multirank" not in tiers:
            raise pytest.UsageError(f"{item.nodeid} runs on the gloo rank pool: mark it multirank")
        if not tiers:
            item.add_marker(pytest.mark.unit)
    order = XDIST_ORDER if os.environ.get("PYTEST_XDIST_WORKER") else ORDER
    items.sort(key=lambda item: order.index(_tier(item)))


# ---- pytest-xdist (make test: -n 2 --dist loadscope) ------------------------------------------------------------------

# a module that makes a fixture once for several of its tests keeps them on one worker
_SHARED_FIXTURE = re.compile(r"""@pytest\.fixture\([^)]*scope=["'](?:module|package|class)["']""")


def _shares_fixtures(path: str) -> bool:
    try:
        return bool(_SHARED_FIXTURE.search(Path(path).read_text()))
    except OSError:
        return False


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadscope`` with this suite's scopes: the tests of a module with a module-scoped fixture are one scope
    (one worker makes the fixture once and runs them all), every other test is a scope of its own, so that the
    multi-rank tests spread over the workers (each worker its own rank pool, its own fork server, its own stores).
    The scopes are handed out in the order the workers collected them (``XDIST_ORDER``), as the workers free up.
    Not ``--dist loadgroup``: pytest 9.2 ignores the node id that pytest-xdist 3.8 rewrites to carry an item's
    ``xdist_group``, so every test became a group of its own there."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SuiteScopes(LoadScopeScheduling):
        def __init__(self, config, log=None):
            super().__init__(config, log)
            config.option.loadscopereorder = False  # the collection's order, not the largest scopes first
            self._module_scope: dict[str, bool] = {}

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            if path not in self._module_scope:
                self._module_scope[path] = _shares_fixtures(str(Path(config.rootpath) / path))
            return path if self._module_scope[path] else nodeid

    return SuiteScopes(config, log)


def pytest_collection_finish(session):
    """Starts the rank pool's fork server if a selected test will use it (after collection: the workers import the
    test modules from the ``sys.path`` of this moment). Not in an xdist worker: each worker's first pool start starts
    its own server, when its first multi-rank test comes (it may get none)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if any(POOL_FIXTURES & set(getattr(item, "fixturenames", ())) for item in session.items):
        from thunder_fp8shard.testing.harness import start_pool_server

        start_pool_server()
