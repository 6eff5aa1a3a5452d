"""The executors of Thunder's own benchmark (``benchmark_litgpt.py --compile=thunder_inductor_cat``), for the tests,
the benchmarks and the GPU runs: ``torch_compile_cat_ex`` first among Thunder's default executors (after
TransformerEngine's, where used). On the CPU, :func:`cat_executor` gives an executor that fuses what
``torch_compile_cat_ex`` fuses, with the same torch.compile regions, but whose checker does not require CUDA
tensors (Thunder's does), so that the CPU tests see the regions users meet on the GPU. Its regions are compiled with
torch.compile's ``aot_eager`` backend: AOTAutograd, which decides how a region's outputs alias its inputs (a view of
an input comes back as a view of it, as under Inductor), without Inductor's C++ code generation on the CPU (seconds
a region in every new process; what users run on the GPU is Inductor's Triton, which no CPU run exercises anyway).
"""

from __future__ import annotations

import functools


@functools.cache
def cat_executor(device_type: str = "cuda"):
    """``torch_compile_cat_ex`` on CUDA; on the CPU a twin of it (same required and supported operators, no CUDA
    check, ``aot_eager``), registered once as ``torchcompile_cat_cpu``."""
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
    """Thunder's benchmark's list: [TransformerEngine's,] the cat executor, then Thunder's defaults (without Thunder's
    sdpa executor when ``sdpa`` is False: flash attention's backward is not bitwise reproducible)."""
    import thunder

    ex = [e for e in thunder.get_default_executors() if sdpa or e.name != "sdpa"]
    ex.insert(0, cat_executor(device_type))
    if transformer_engine:
        from thunder.executors.transformer_engineex import transformer_engine_ex

        ex.insert(0, transformer_engine_ex)
    return ex
