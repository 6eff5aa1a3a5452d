"""The executors of Thunder's own benchmark: ``torch_compile_cat_ex`` first. On the CPU a twin without its CUDA check,
compiling with ``aot_eager`` (Inductor's aliasing without its slow C++ codegen), lets CPU tests see the same regions."""

from __future__ import annotations

import functools


@functools.cache
def cat_executor(device_type: str = "cuda"):
    """``torch_compile_cat_ex`` on CUDA; on the CPU its twin, registered once as ``torchcompile_cat_cpu``."""
    from thunder.executors.torch_compile import TorchCompileExecutor, torch_compile_cat_ex
    from thunder.extend import ImplInfo, register_executor

    if device_type == "cuda":
        return torch_compile_cat_ex

    class CpuTwin(TorchCompileExecutor):
        def fuse(self, region, fusion_counter: int):
            import torch

            compile_ = torch.compile
            torch.compile = functools.partial(compile_, backend="aot_eager")  # Thunder's make_compiled calls it
            try:
                return super().fuse(region, fusion_counter)
            finally:
                torch.compile = compile_

    twin = CpuTwin(name="torchcompile_cat_cpu", required_ops=torch_compile_cat_ex.required_ops)
    twin._implmap = {op: ImplInfo() for op in torch_compile_cat_ex._implmap}
    register_executor(twin)
    return twin


def benchmark_executors(device_type: str = "cuda", *, transformer_engine: bool = False, sdpa: bool = True) -> list:
    """Thunder's benchmark's list: [TransformerEngine's,] the cat executor, then Thunder's defaults (without sdpa when
    ``sdpa`` is False: flash attention's backward is not bitwise reproducible)."""
    import thunder

    ex = [e for e in thunder.get_default_executors() if sdpa or e.name != "sdpa"]
    ex.insert(0, cat_executor(device_type))
    if transformer_engine:
        from thunder.executors.transformer_engineex import transformer_engine_ex

        ex.insert(0, transformer_engine_ex)
    return ex
