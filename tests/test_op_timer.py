"""``paired.py --decompose-iters`` (``benchmarks/benchlib/op_timer.py``, ``benchlib.stats.op_summary``/``pass_cpu``):
the wrappers are what an already-compiled Thunder program calls, the times are self times, the pass's net and gross
CPU a step are the arithmetic they say, and a short CPU run of ``paired.py`` reports them."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import time_cpu as summary  # noqa: E402
from benchlib import op_timer, stats  # noqa: E402


def test_pass_cpu_is_the_arms_ms_less_the_bases_summed_and_the_gross_is_its_own_operators():
    base = stats.op_summary([{"torch_all_gather_prim_impl": (4, 2_000_000), "torch_wait_prim_impl": (4, 400_000)},
                             {"torch_all_gather_prim_impl": (4, 4_000_000), "torch_wait_prim_impl": (4, 600_000)}])
    # (calls, wall ns): the wall stands for the cpu too; (calls, wall ns, cpu ns): the cpu is "ms"
    assert base["torch_all_gather_prim_impl"] == {"calls": 4.0, "ms": 3.0, "ms_min": 2.0, "ms_max": 4.0, "wall_ms": 3.0}
    assert stats.op_summary([{"x": (1, 5_000_000, 1_000_000)}])["x"] == {"calls": 1.0, "ms": 1.0, "ms_min": 1.0,
                                                                        "ms_max": 1.0, "wall_ms": 5.0}
    arm = stats.op_summary([{"torch_all_gather_prim_impl": (2, 1_000_000), "fp8shard_gather_next": (3, 1_500_000)},
                            {"torch_all_gather_prim_impl": (2, 1_000_000), "fp8shard_gather_next": (3, 2_500_000),
                             "fp8shard_rev_shard": (1, 200_000)}])
    assert arm["fp8shard_rev_shard"] == {"calls": 0.5, "ms": 0.1, "ms_min": 0.0, "ms_max": 0.2, "wall_ms": 0.1}
    got = stats.pass_cpu(base, arm, 2)
    assert got["net_ms_per_step"] == pytest.approx((1.0 - 3.0) + (0.0 - 0.5) + 2.0 + 0.1)
    assert got["gross_ms_per_step"] == pytest.approx(2.1) and got["iterations"] == 2
    rows = {r["operator"]: r for r in got["by_operator"]}
    assert rows["torch_wait_prim_impl"] == {"operator": "torch_wait_prim_impl", "pass": False, "arm_calls": 0.0,
                                            "arm_ms": 0.0, "base_calls": 4.0, "base_ms": 0.5, "diff_ms": -0.5,
                                            "diff_wall_ms": -0.5}
    assert rows["fp8shard_rev_shard"]["pass"] and not rows["torch_all_gather_prim_impl"]["pass"]
    assert [r["operator"] for r in got["by_operator"]][:2] == ["fp8shard_gather_next", "torch_all_gather_prim_impl"]
    md = summary.table({"arm": "x", "base": "b", "null": False, "pass_cpu": got}, top=2)
    assert "net -0.400 ms of CPU a step (wall -0.400), gross 2.100 ms" in md and md.count("\n| `") == 2


class _Clock:
    def __init__(self):
        self.now = 0

    def __call__(self):
        return self.now


def test_nested_operators_count_their_self_time_once():
    clock = _Clock()

    def inner():
        clock.now += 5

    def outer():
        clock.now += 1
        g["inner"]()  # through the program's globals, as a compiled program calls an operator
        clock.now += 2

    g = {"inner": inner, "outer": outer}
    exec(compile("def computation():\n    outer()\n    inner()\n", "thunder.computation_0", "exec"), g)
    t = op_timer.OpTimer(("inner", "outer"), clock=clock, cpu_clock=clock)
    assert t.install([g["computation"]]) == 2 and t.install([g["computation"]]) == 2  # once, however often
    g["computation"]()
    assert t.take() == {"outer": (1, 3, 3), "inner": (2, 10, 10)}
    t.uninstall()
    assert g["inner"] is inner and g["outer"] is outer


def test_the_te_linear_the_pass_calls_counts_as_te_s_not_the_pass_s():
    from thunder_fp8shard.runtime.fp8_gather_ops import WeightGatherSpec

    clock = _Clock()

    def te_linear_fwd():
        clock.now += 7

    def fused(spec):  # fp8shard_te_linear_fwd: the wait, then the TE linear forward it replaced
        clock.now += 2
        spec.linear()

    spec = WeightGatherSpec(None, 2, 0, 2, 2, 4, 3, torch.bfloat16, "w", te_linear_fwd)
    g = {"fp8shard_te_linear_fwd": fused, "_WeightGatherSpec_0": spec}
    exec(compile("def computation():\n    fp8shard_te_linear_fwd(_WeightGatherSpec_0)\n", "thunder.c_1", "exec"), g)
    t = op_timer.OpTimer(op_timer.names(), clock=clock, cpu_clock=clock)
    assert t.install([g["computation"]]) == 2
    g["computation"]()
    assert t.take() == {"fp8shard_te_linear_fwd": (1, 2, 2), "te_functional_linear_fwd": (1, 7, 7)}
    t.uninstall()
    assert spec.linear is te_linear_fwd and g["fp8shard_te_linear_fwd"] is fused


def test_the_wrappers_are_what_an_already_compiled_program_calls(single_rank_group):
    import thunder
    from thunder.distributed import FSDPType
    from thunder.distributed.transforms.fsdp_v2 import FSDPTransform

    from thunder_fp8shard.testing.toy_models import FakeFP8MLP

    torch.manual_seed(0)
    jm = thunder.jit(FakeFP8MLP(), transforms=[FSDPTransform(device=torch.device("cpu"),
                                                             sharding_strategy=FSDPType.ZERO3)])
    x = torch.randn(3, 24, requires_grad=True)
    jm(x).sum().backward()  # compiled before the wrappers exist
    t = op_timer.OpTimer(op_timer.names())
    assert t.install(op_timer.programs(jm)) > 0
    jm(x).sum().backward()
    first = t.take()
    params = len(list(jm.parameters()))
    assert first["torch_all_gather_prim_impl"][0] >= params and first["torch_reduce_scatter_prim_impl"][0] == params
    assert first["torch_wait_prim_impl"][0] > 0 and all(ns > 0 for _, ns, _ in first.values())
    jm(x).sum().backward()
    assert {k: c for k, (c, *_) in t.take().items()} == {k: c for k, (c, *_) in first.items()}
    t.uninstall()
    jm(x).sum().backward()
    assert t.take() == {}


@pytest.mark.simulated
@pytest.mark.parametrize("mode", ["one-kernel", "fake-group"])
def test_a_cpu_paired_run_reports_the_pass_cpu_under_either_simulation(mode, tmp_path):
    """``paired.py --device cpu --simulate 2 --one-model`` (pythia-14m, 2 layers): each JSON says which collectives
    ran and has ``pass_cpu``; the arm with the pass counts its own operators, the null arm none."""
    for module in ("litgpt", "jsonargparse"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (Thunder's benchmark needs it)")
    out = str(tmp_path / "p")
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "paired.py"), "--device", "cpu", "--simulate", "2",
           "--one-model", "--timed", "2", "--warmup-quads", "1", "--sim-collectives", mode, "--arms",
           '{"without": null, "all": {"candidates": "all"}, "null": null}', "--out", out, "--",
           "--distributed_mode=fsdp", "--shard_mode=zero3", "--model_name=pythia-14m", "--n_layers=2",
           "--block_size=64", "--compile=thunder"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, *sys.path])}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    arm, null = (json.load(open(f"{out}_{name}.json")) for name in ("all", "null"))
    assert arm["sim_collectives"] == mode and mode in arm["communication"]
    if mode == "one-kernel":
        assert arm["sim_collective_calls"]["_allgather_base"] > 0 and "delegated" not in arm["sim_collective_calls"]
    p = arm["pass_cpu"]
    assert p["iterations"] == 5 and arm["pass_cpu_ms_per_step"] == p["net_ms_per_step"]
    own = {r["operator"]: r for r in p["by_operator"] if r["pass"]}
    assert own and all(r["arm_calls"] > 0 and r["base_calls"] == 0 for r in own.values())
    assert p["gross_ms_per_step"] > 0
    assert not [r for r in null["pass_cpu"]["by_operator"] if r["pass"]]
    assert arm["op_cpu"]["arms"]["without"]["operators"]["torch_all_gather_prim_impl"]["calls"] > 0
