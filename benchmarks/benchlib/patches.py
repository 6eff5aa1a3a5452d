"""Patches to Thunder's ``thunder/benchmarks/benchmark_litgpt.py`` (``bl``) and its surroundings, made at run time so
that the installed benchmark itself runs unchanged: simulated ranks under torch's fake process group, the CPU instead
of CUDA, the pass appended to the transforms while the benchmark compiles, and the pass's all-gathers on a stream of
their own. :func:`simulate` and :func:`on_the_cpu` must run before ``bl`` is imported (it initializes the process
group and picks its device when imported)."""

from __future__ import annotations

import contextlib
import functools
import os


def on_the_cpu() -> None:
    """Thunder's benchmark module picks CUDA device ``LOCAL_RANK`` when it is imported, and Thunder FSDP materializes
    on CUDA by default: both go to the CPU instead. (Set ``bl.device`` to the CPU after importing ``bl``.)"""
    import thunder.distributed
    import torch

    torch.cuda.set_device = lambda *a, **k: None
    thunder.distributed.fsdp = functools.partial(thunder.distributed.fsdp, device=torch.device("cpu"))


def simulate(world_size: int, collectives: str = "one-kernel") -> None:
    """Rank 0 of ``world_size`` in torch's fake process group: Thunder's benchmark module initializes NCCL when it is
    imported; that call joins the fake group instead. ``collectives``: ``"one-kernel"``, each collective one kernel
    (:mod:`benchlib.collectives`), or ``"fake-group"``, the fake group's own (N copies an all-gather, nothing for the
    others)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from benchlib import collectives as sim

    if collectives not in sim.MODES:
        raise ValueError(f"collectives: one of {sim.MODES}, got {collectives!r}")
    if collectives == "one-kernel":
        sim.install()

    os.environ.update(WORLD_SIZE=str(world_size), RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    real = dist.init_process_group

    def fake(*args, **kwargs):
        dist.init_process_group = real
        return real("fake", store=FakeStore(), rank=0, world_size=world_size)

    dist.init_process_group = fake


def pass_gathers_on_their_own_stream() -> None:
    """``--comm-stream``: the pass's all-gathers keep ProcessGroupNCCL's stream protocol over the fake group.

    The simulated all-gather (one kernel, or the fake group's N copies) writes the output on the *current* stream, so
    under ``--simulate`` the pass's gathers (the whole gathered bytes of every bucket, a step) run on the compute stream,
    in a backward that keeps the GPU busy; NCCL runs them on a stream of its own, which first waits for the compute
    stream, and ``wait()`` makes the compute stream wait for it. This does the same around the group's call: the
    output is allocated on the compute stream, as the pass does, the copies run on a side stream, and the handle's
    ``wait`` is a stream wait. The bytes the copies write are the gathered buffer's, as NCCL's are. Only the pass's
    operators (``thunder_fp8shard.runtime.ops``) are patched; FSDP's own gathers stay on the compute stream on every arm."""
    import torch
    from thunder_fp8shard.runtime import ops

    side = torch.cuda.Stream()

    class StreamWork:
        __slots__ = ("event",)

        def __init__(self, event):
            self.event = event

        def wait(self):
            torch.cuda.current_stream().wait_event(self.event)

    def gather_start(shard, offset, nbytes, k, group):
        if type(shard) is tuple:  # a bucket's sources (own shards): one coalesced all-gather into one buffer
            ins = [s.detach().reshape(-1).view(torch.uint8) for s in shard]
            out = ins[0].new_empty(nbytes)
            outs = [out[o : o + x.numel() * k] for o, x in zip(offset, ins)]
        else:
            ins = [shard if nbytes == shard.numel() else shard[offset : offset + nbytes]]
            out = shard.new_empty(nbytes * k)
            outs = [out]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            if len(ins) == 1:
                group._allgather_base(outs[0], ins[0], ops._ASYNC)
            else:
                group.allgather_into_tensor_coalesced(outs, ins, ops._ASYNC)
            event = torch.cuda.Event()
            event.record(side)
        out.record_stream(side)
        for t in ins:
            t.record_stream(side)
        return ops.GatherHandle(StreamWork(event), out)

    ops._gather_start = gather_start  # the operators fp8shard_gather_start and _gather_next look it up at each call


@contextlib.contextmanager
def pass_appended(bl, shard):
    """While ``Benchmark_litGPT.setup_compile`` runs: ``thunder.jit`` and ``ThunderCompiler`` get ``shard`` as their
    last transform (``shard`` None: nothing is patched). Only there: ``thunder.distributed.fsdp`` re-jits afterwards
    through ``add_transform``, keeping the transforms it finds, so the pass is in the list exactly once."""
    import thunder

    if shard is None:
        yield
        return
    setup_compile = bl.Benchmark_litGPT.setup_compile

    def setup_compile_with_pass(self, model):
        real_jit, real_compiler = thunder.jit, bl.ThunderCompiler

        def jit(fn, *a, transforms=None, **kw):
            return real_jit(fn, *a, transforms=[*(transforms or []), shard], **kw)

        def compiler(*a, transforms=None, **kw):
            return real_compiler(*a, transforms=[*(transforms or []), shard], **kw)

        thunder.jit, bl.ThunderCompiler = jit, compiler
        try:
            return setup_compile(self, model)
        finally:
            thunder.jit, bl.ThunderCompiler = real_jit, real_compiler

    bl.Benchmark_litGPT.setup_compile = setup_compile_with_pass
    try:
        yield
    finally:
        bl.Benchmark_litGPT.setup_compile = setup_compile
