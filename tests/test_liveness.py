"""Tests of the liveness/memory model (thunder_fp8shard.analysis.liveness) and its plot, on CPU, single process."""

from __future__ import annotations

import pytest
import thunder
import thunder.executors.torchex as tx
import torch
from thunder.core import devices, dtypes, prims
from thunder.core.proxies import CollectionProxy, FutureTensorProxy, TensorProxy
from thunder.core.trace import TraceCtx, from_trace, tracectx
from thunder.executors.pythonex import clear_mutable_collection
from torch import nn

from thunder_fp8shard.analysis.liveness import (
    Life,
    ShardedStorages,
    Step,
    joint_graph,
    program_steps,
    storage_lives,
    timeline,
    uses,
    with_sharding,
)
from thunder_fp8shard.reporting.plot import plot_timelines


def _tensor(name: str, shape: tuple[int, ...], dtype=dtypes.float32) -> TensorProxy:
    return TensorProxy(name, shape=shape, dtype=dtype, device=devices.cpu, requires_grad=False)


def _hand_traces():
    """A forward/backward pair whose answers are worked out by hand (f32: 4 bytes per element).

    forward(x[4,4], w[4,4]):                 backward(([b, w], []), [g[2,16]]):
      0  a = mul(x, w)        64 B             5  h = mul(g, b)          128 B  (last use of b)
      1  b = reshape(a, 16)   view of a        6  del b
      2  c = neg(b)           64 B, output     7  s = reshape(w, 16)     view of w
      3  del a                                 8  gw = mul(h, s)         128 B  (last use of h and w)
      4  return c, saved (b, w)                9  clear_mutable_collection(hs)  (hs holds h)
                                               10 del h, s, w
                                               11 return (gw,)
    """
    fw = TraceCtx()
    with tracectx(fw):
        x, w = _tensor("x", (4, 4)), _tensor("w", (4, 4))
        fw.args = (x, w)
        a = tx.mul(x, w)
        b = tx.reshape(a, (16,))
        c = tx.neg(b)
        prims.python_del(a)
        prims.python_return({"output": (c,), "flat_args": [x, w], "flat_output": (c,)}, ((b, w), ()))
    bw = from_trace(fw)  # shares the proxy names with fw, as Thunder's backward does
    with tracectx(bw):
        g = _tensor("g", (2, 16))
        bw.args = ([[b, w], []], [g])
        h = tx.mul(g, b)
        prims.python_del(b)
        s = tx.reshape(w, (16,))
        gw = tx.mul(h, s)
        clear_mutable_collection(CollectionProxy([h], name="hs"))
        prims.python_del(h, s, w)
        prims.python_return((gw,))
    return fw, bw, dict(x=x, w=w, a=a, b=b, c=c, g=g, h=h, s=s, gw=gw)


# live bytes per step of the hand traces, from the intervals in test_hand_intervals
HAND_LIVE = (192, 192, 256, 256, 256, 384, 192, 192, 320, 128, 128, 128)


def test_hand_steps():
    fw, bw, p = _hand_traces()
    steps = program_steps(fw, bw)
    assert [s.index for s in steps] == list(range(12))
    assert [s.phase for s in steps] == ["forward"] * 5 + ["backward"] * 7
    assert steps[0].label == f"{p['a'].name} = torch.mul"
    assert steps[3].label == f"del {p['a'].name}"
    assert steps[9].label == "clear_mutable_collection"
    assert steps[4].label == steps[11].label == "return"


def test_hand_intervals():
    fw, bw, p = _hand_traces()
    n = {k: v.name for k, v in p.items()}
    lives = storage_lives(fw, bw)
    assert lives == {
        # inputs: from step 0, through the forward (4) or to the last backward use
        "x": Life("x", ("x",), 64, 0, 4),
        "w": Life("w", ("w", n["s"]), 64, 0, 8),
        # the reshape b is counted once with a, keeps it alive after `del a`, and is saved: lives to step 5
        n["a"]: Life(n["a"], (n["a"], n["b"]), 64, 0, 5),
        n["c"]: Life(n["c"], (n["c"],), 64, 2, 4),  # forward output: to the end of the forward
        "g": Life("g", ("g",), 128, 5, 5),  # cotangent: from the first backward step
        n["h"]: Life(n["h"], (n["h"],), 128, 5, 8),  # the clear and del (9, 10) do not extend it
        n["gw"]: Life(n["gw"], (n["gw"],), 128, 8, 11),  # gradient: to the end of the backward
    }


def test_hand_timeline():
    fw, bw, p = _hand_traces()
    t = timeline(storage_lives(fw, bw), program_steps(fw, bw))
    assert t.live_bytes == HAND_LIVE
    assert t.backward_start == 5
    assert t.peak_bytes == 384
    assert t.peak_step.index == 5 and t.peak_step.label == f"{p['h'].name} = torch.mul"


def test_nbytes_of_overrides_sizes():
    fw, bw, _ = _hand_traces()
    lives = storage_lives(fw, bw, nbytes_of=lambda proxy: proxy.numel)  # 1 byte per element
    assert {k: life.nbytes for k, life in lives.items()} == {k: life.nbytes // 4 for k, life in storage_lives(fw, bw).items()}


def test_joint_graph_edges():
    fw, bw, p = _hand_traces()
    g = joint_graph(fw, bw)
    a, b = p["a"].name, p["b"].name
    assert g.graph["backward_start"] == 5
    assert list(g.predecessors(a)) == [0] and sorted(g.successors(a)) == [1, 3]
    # the saved tensor b joins its forward producer to its backward uses under the same name
    assert list(g.predecessors(b)) == [1] and sorted(g.successors(b)) == [2, 4, 5, 6]
    assert uses(g, [a, b]) == (1, 2, 5)  # del (3, 6) and return (4) are not uses
    assert g.nodes[5]["phase"] == "backward" and g.nodes[5]["bsym"].sym.name == "mul"
    assert g.nodes["g"]["nbytes"] == 128


def test_with_sharding_lowers_between_shard_and_gather():
    fw, bw, p = _hand_traces()
    steps = program_steps(fw, bw)
    lives = storage_lives(fw, bw)
    a = p["a"].name  # saved via its view b; last forward use 2, first backward use 5
    plan = ShardedStorages("g", (a,), shard_nbytes=16, gathered_nbytes=64, shard_at=2, gather_at=5, first_use=5)
    sharded = with_sharding(lives, steps, [plan])
    assert sharded[a] == Life(a, (a, p["b"].name), 64, 0, 2)
    assert sharded["g.shard"] == Life("g.shard", (), 16, 2, 5)
    assert sharded["g.gathered"] == Life("g.gathered", (a, p["b"].name), 64, 5, 5)
    delta = [x - y for x, y in zip(timeline(sharded, steps).live_bytes, HAND_LIVE)]
    # full and shard overlap at shard_at and at the gather; strictly between, 64 - 16 bytes are saved
    assert delta == [0, 0, 16, -48, -48, 16, 0, 0, 0, 0, 0, 0]
    assert lives[a].end == 5  # the input mapping is not modified


@pytest.mark.parametrize(
    "shard_at, gather_at, first_use",
    [(5, 5, 5), (2, 3, 5), (2, 5, 4), (2, 5, 6)],  # shard in backward; gather in forward; gather after use; use after end
)
def test_with_sharding_rejects_impossible_plans(shard_at, gather_at, first_use):
    fw, bw, p = _hand_traces()
    a = p["a"].name  # lives [0, 5]
    plan = ShardedStorages("g", (a,), 16, 64, shard_at, gather_at, first_use)
    with pytest.raises(ValueError):
        with_sharding(storage_lives(fw, bw), program_steps(fw, bw), [plan])


def test_a_bucket_is_one_shard_and_one_gathered_buffer_living_to_its_last_members_end():
    steps = tuple(Step(i, "forward" if i < 4 else "backward", f"op{i}") for i in range(8))
    lives = {"u": Life("u", ("u", "u_view"), 40, 0, 5), "v": Life("v", ("v",), 60, 1, 7)}
    bucket = ShardedStorages("b0", ("u", "v"), shard_nbytes=56, gathered_nbytes=112, shard_at=2, gather_at=4, first_use=5)
    out = with_sharding(lives, steps, [bucket])
    assert out["u"] == Life("u", ("u", "u_view"), 40, 0, 2) and out["v"] == Life("v", ("v",), 60, 1, 2)
    assert out["b0.shard"] == Life("b0.shard", (), 56, 2, 5)
    # the members are views of one buffer: it is freed when the last of them dies (v, at 7)
    assert out["b0.gathered"] == Life("b0.gathered", ("u", "u_view", "v"), 112, 4, 7)
    assert timeline(out, steps).live_bytes == (40, 100, 156, 56, 168, 168, 112, 112)


def test_future_tensor_counts_by_its_buffer():
    """all_gather -> wait -> getitem -> reshape (the pass's restore chain) is one storage: the gathered buffer."""
    fw, _, p = _hand_traces()
    bw2 = from_trace(fw)
    with tracectx(bw2):
        shard, g = _tensor("shard", (8,)), _tensor("cot", (2, 16))
        bw2.args = ([[shard], []], [g])
        ft = FutureTensorProxy(shape=(18,), device=devices.cpu, dtype=dtypes.float32)
        full = TensorProxy(like=p["b"], shape=(18,))
        bw2.bound_symbols.append(tx.all_gather_prim_impl.bind(shard, None, True, None, output=ft))
        bw2.bound_symbols.append(tx.wait_prim_impl.bind(ft, output=full))
        piece = tx.getitem(full, slice(0, 16))
        b = tx.reshape(piece, (16,))
        h = tx.mul(g, b)
        prims.python_return((h,))
    lives = storage_lives(fw, bw2)
    buf = lives[ft.name]
    assert buf == Life(ft.name, (ft.name, full.name, piece.name, b.name), 72, 5, 9)
    assert lives["shard"] == Life("shard", ("shard",), 32, 5, 5)  # an input of this backward, used by the gather


def _sequential_traces():
    torch.manual_seed(0)
    jm = thunder.jit(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    jm(torch.randn(3, 4, requires_grad=True)).sum().backward()
    entry = thunder.compile_stats(jm).interpreter_cache[0]
    return entry.computation_traces[-1], entry.backward_traces[-1]


def test_thunder_jit_traces():
    fw, bw = _sequential_traces()
    steps = program_steps(fw, bw)
    lives = storage_lives(fw, bw)
    t = timeline(lives, steps)
    assert len(steps) == len(fw.bound_symbols) + len(bw.bound_symbols)
    assert t.backward_start == len(fw.bound_symbols)
    # storage is counted once: every proxy name is in exactly one life
    names = [m for life in lives.values() for m in life.members]
    assert len(names) == len(set(names))
    # the backward's unpack of C0 allocates nothing: saved names keep their forward lives, into the backward
    _, (saved, _) = fw.bound_symbols[-1].args
    for proxy in saved:
        (life,) = [life for life in lives.values() if proxy.name in life.members]
        assert life.start < t.backward_start < life.end
    # the relu mask (bool) is last used by the backward's where
    (mask,) = [p for p in saved if p.dtype == dtypes.bool8]
    (gt,) = [s.index for s in steps if s.label == f"{mask.name} = torch.gt"]
    (where,) = [s.index for s in steps if s.phase == "backward" and s.label.endswith("torch.where")]
    assert lives[mask.name] == Life(mask.name, (mask.name,), 3 * 8 * 1, gt, where)
    # forward peak, by hand: x 3x4, params 8 + 8x4 + 2 + 2x8, linear out 3x8, mask 3x8 (1 B), relu out 3x8
    assert t.peak_bytes == 4 * (12 + 8 + 32 + 2 + 16) + 4 * 24 + 24 + 4 * 24
    assert t.peak_step.phase == "forward" and t.peak_step.label.endswith("torch.where")


def test_plot(tmp_path):
    fw, bw, p = _hand_traces()
    steps = program_steps(fw, bw)
    lives = storage_lives(fw, bw)
    before = timeline(lives, steps)
    plan = ShardedStorages("g", (p["a"].name,), shard_nbytes=16, gathered_nbytes=64, shard_at=2, gather_at=5, first_use=5)
    after = timeline(with_sharding(lives, steps, [plan]), steps)
    path = tmp_path / "memory.png"
    fig = plot_timelines(before, after, gathers=[5], title="hand", path=path)
    (ax,) = fig.axes
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {"before", "after", "peak before", "peak after", "backward", "all-gather"}
    assert list(lines["before"].get_ydata()) == list(HAND_LIVE)  # under 1 KiB: the unit is bytes
    assert ax.get_ylabel() == "live memory (B)" and ax.get_title() == "hand"
    assert list(lines["peak before"].get_xydata()[0]) == [5, 384]
    assert list(lines["peak after"].get_xydata()[0]) == [5, 400]
    assert list(lines["backward"].get_xdata()) == [4.5, 4.5]
    assert list(lines["all-gather"].get_xydata()[0]) == [5, 400]
    assert any("peak 384 B" in text.get_text() for text in ax.texts)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
