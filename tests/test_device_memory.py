"""What the pass reads from the device while compiling (thunder_fp8shard.memory.device), on the CPU: the CUDA
allocator is replaced by a counter and TransformerEngine by stand-in modules of each API generation, so forcing the
TE GEMM workspace is checked for every outcome: created, already there, an API it does not know (never 0 B)."""

from __future__ import annotations

import contextlib
import sys
import types
import warnings

import pytest
import torch
from thunder.core import devices, dtypes
from thunder.core.proxies import TensorProxy
from thunder.core.trace import TraceCtx, tracectx

from thunder_fp8shard.memory import device as device_memory
from thunder_fp8shard.memory.device import DeviceMemory, measure
from thunder_fp8shard.plan import UNKNOWN
from thunder_fp8shard.memory.resident import workspaces_not_forced

TE_WORKSPACE = 32 * 1024 * 1024 + 1024  # TE >= 2.10 on compute capability >= 9.0
TE_MODULES = ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.cpp_extensions",
              "transformer_engine.pytorch.cpp_extensions.gemm", "transformer_engine.pytorch.module",
              "transformer_engine.pytorch.module.base")


@pytest.fixture
def allocator(monkeypatch):
    """A fake CUDA allocator: ``allocated[0]`` is what ``memory_allocated`` reads; forcing cuBLAS adds 100 B."""
    allocated = [1000]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated[0])
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(device_memory, "_run_gemms", lambda dev, bias: allocated.__setitem__(0, allocated[0] + 100))
    monkeypatch.setattr(device_memory, "_release_cublas_workspaces", lambda: allocated.__setitem__(0, allocated[0] - 100))
    return allocated


def _fake_te(monkeypatch, *, gemm=None, base=None):
    """Stand-ins for TE's modules, holding only the given attributes."""
    for name in TE_MODULES:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    for name, attrs in (("cpp_extensions.gemm", gemm or {}), ("module.base", base or {})):
        for k, v in attrs.items():
            setattr(sys.modules[f"transformer_engine.pytorch.{name}"], k, v)


def _cuda_trace():
    trace = TraceCtx()
    with tracectx(trace):
        trace.args = (TensorProxy("x", shape=(4, 4), dtype=dtypes.bfloat16, device=devices.to_device("cuda:0"),
                                  requires_grad=False),)
    return trace


def _measure_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return measure(_cuda_trace(), transformer_engine=True)


def test_te_2_10_and_later_workspace_is_forced_with_the_cache_key_of_its_gemms(allocator, monkeypatch):
    calls = []

    def get_cublas_workspace(*args, **kwargs):
        calls.append((args, kwargs))
        allocator[0] += TE_WORKSPACE

    _fake_te(monkeypatch, gemm={"get_cublas_workspace": get_cublas_workspace},
             base={"get_workspace": lambda: pytest.fail("the old API was used while the new one exists")})
    m = _measure_without_warnings()
    assert m == DeviceMemory("cuda:0", 1000, (("cuBLAS", 100), ("TransformerEngine GEMM", TE_WORKSPACE)))
    # general_gemm calls get_cublas_workspace(A.device.index, ub is not None, False): an lru_cache keyed on
    # exactly these positional values, so any other spelling would create a second workspace
    assert calls == [((0, False, False), {})] and type(calls[0][0][0]) is int


def test_te_2_9_and_earlier_workspace_is_forced_through_module_base(allocator, monkeypatch):
    def get_workspace():
        allocator[0] += TE_WORKSPACE

    _fake_te(monkeypatch, base={"get_workspace": get_workspace})
    assert _measure_without_warnings().workspaces == (("cuBLAS", 100), ("TransformerEngine GEMM", TE_WORKSPACE))


def test_a_te_workspace_that_already_existed_adds_nothing_and_is_no_failure(allocator, monkeypatch):
    _fake_te(monkeypatch, gemm={"get_cublas_workspace": lambda *a: None})  # cached: no allocation
    m = _measure_without_warnings()
    assert m.workspaces[-1] == ("TransformerEngine GEMM", 0) and m.not_forced == ()


def test_an_unknown_te_api_is_reported_as_not_forced_never_as_zero_bytes(allocator, monkeypatch):
    _fake_te(monkeypatch)  # neither API
    with pytest.warns(RuntimeWarning, match="could not force the TransformerEngine GEMM workspace into existence"):
        m = measure(_cuda_trace(), transformer_engine=True)
    assert m.workspaces == (("cuBLAS", 100),)  # no "TransformerEngine GEMM 0 B"
    ((kind, why),) = m.not_forced
    assert kind == "TransformerEngine GEMM"
    assert "cannot import name 'get_cublas_workspace'" in why and "cannot import name 'get_workspace'" in why
    assert "32 MiB (+ 1 KiB since 2.8) a device on compute capability >= 9.0" in why
    (term,) = workspaces_not_forced(m)
    assert (term.name, term.source, term.spans) == ("TransformerEngine GEMM workspace", UNKNOWN, ())


def test_a_forcing_call_that_raises_is_reported_with_its_error(allocator, monkeypatch):
    def get_cublas_workspace(*args):
        raise RuntimeError("CUDA error: out of memory")

    _fake_te(monkeypatch, gemm={"get_cublas_workspace": get_cublas_workspace})
    with pytest.warns(RuntimeWarning, match="CUDA error: out of memory"):
        m = measure(_cuda_trace(), transformer_engine=True)
    assert m.workspaces == (("cuBLAS", 100),)
    assert m.not_forced[0][1].startswith("RuntimeError: CUDA error: out of memory")


def test_te_is_not_asked_for_when_the_program_has_no_te_ops(allocator, monkeypatch):
    _fake_te(monkeypatch, gemm={"get_cublas_workspace": lambda *a: pytest.fail("TE was asked for")})
    m = measure(_cuda_trace(), transformer_engine=False)
    assert m == DeviceMemory("cuda:0", 1000, (("cuBLAS", 100),))


def test_the_cublas_workspaces_forced_are_measured_then_released(allocator, monkeypatch):
    """The pass leaves no cuBLAS workspace of its own making behind (on the H200 every step of the GPU tests' tiny
    model began 33.8 MB higher with the pass, one such workspace's size): measured, then released; the program makes
    again those it uses."""
    kinds, released = [], []
    monkeypatch.setattr(device_memory, "_run_gemms", lambda dev, bias: (kinds.append(bias), allocator.__setitem__(
        0, allocator[0] + 100)))
    monkeypatch.setattr(device_memory, "_release_cublas_workspaces", lambda: (released.append(allocator[0]),
                                                                              allocator.__setitem__(0, 1000)))
    assert measure(_cuda_trace(), transformer_engine=False, cublas={"matmul"}).workspaces == (("cuBLAS", 100),)
    assert (kinds, released, allocator[0]) == ([False], [1100], 1000)
    measure(_cuda_trace(), transformer_engine=False, cublas={"bmm", "linear"})  # a GEMM with a bias: cuBLASLt too
    assert kinds == [False, True]
    assert measure(_cuda_trace(), transformer_engine=False, cublas=frozenset()).workspaces == ()
    assert len(released) == 2  # nothing forced, nothing released


def test_the_gemms_that_are_not_transformer_engines_are_found_inside_fusion_regions_too():
    from thunder_fp8shard.memory.device import cublas_gemms

    def bsym(name, subsymbols=(), fusion=False):
        return types.SimpleNamespace(sym=types.SimpleNamespace(name=name, is_fusion=fusion), subsymbols=subsymbols)

    trace = types.SimpleNamespace(bound_symbols=[
        bsym("te_functional_linear_fwd"), bsym("TorchCompile0", [bsym("bmm"), bsym("add")], fusion=True),
        bsym("linear")])
    assert cublas_gemms(trace) == {"bmm", "linear"}
    assert cublas_gemms(types.SimpleNamespace(bound_symbols=[bsym("te_functional_linear_fwd")])) == frozenset()
