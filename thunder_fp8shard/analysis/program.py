"""The facts of one compiled program the stages read, derived once by :func:`program_facts` so each fact has one
rule."""

from __future__ import annotations

import functools
from collections.abc import Set
from dataclasses import dataclass

import networkx as nx
from thunder.core.proxies import Proxy, TensorProxy
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx

from thunder_fp8shard.analysis.candidates import payload_nbytes, te_quantized_names
from thunder_fp8shard.analysis.liveness import (
    Life, Step, forward_return, joint_graph, program_steps, storage_lives, storage_of,
)
from thunder_fp8shard.analysis.fsdp_gathers import Gather, forward_gathers
from thunder_fp8shard.analysis.saved import body_without_dels, forward_inputs, forward_outputs, forward_saved


@dataclass(frozen=True)
class ProgramFacts:
    """The joint forward + backward program before anything is decided; plain data, never modified."""

    forward: TraceCtx
    backward: TraceCtx
    saved: tuple[TensorProxy, ...]  # in order; a name may repeat
    saved_other: tuple  # the forward's saved non-tensor values, in order
    args: tuple[Proxy, ...]  # args then kwargs, flattened
    outputs: tuple[Proxy, ...]  # the forward's output and flat_output tensors, each once
    model_io: frozenset[str]  # the forward's inputs and outputs: the caller keeps them alive
    te_names: frozenset[str]  # their proxies print the high-precision dtype
    backward_start: int  # the first backward step of the joint timeline
    steps: tuple[Step, ...]  # one a bound symbol: the forward's, then the backward's
    graph: nx.DiGraph  # liveness.joint_graph of the two traces
    lives: dict[str, Life]  # TE quantized tensors at their payload
    device: str | None  # of the forward's inputs; None: the CPU

    @property
    def last_step(self) -> int:
        """The joint timeline's last step (the backward's return)."""
        return len(self.steps) - 1

    @property
    def inputs(self) -> tuple[TensorProxy, ...]:
        """The forward's tensor inputs (parameters, the batch), in order."""
        return tuple(p for p in self.args if isinstance(p, TensorProxy))

    @functools.cached_property
    def body(self) -> tuple[BoundSymbol, ...]:
        """The forward's bound symbols without its dels."""
        return tuple(body_without_dels(self.forward))

    @functools.cached_property
    def gathers(self) -> tuple[Gather, ...]:
        """Thunder FSDP's gather chains in the forward, found once (:mod:`~thunder_fp8shard.analysis.fsdp_gathers`)."""
        return forward_gathers(self.body)

    @functools.cached_property
    def life_of(self) -> dict[str, Life]:
        """Tensor name -> its storage's life."""
        return storage_of(self.lives)

    @property
    def saved_names(self) -> frozenset[str]:
        return frozenset(p.name for p in self.saved)

    def nbytes(self, p: TensorProxy) -> int:
        """What ``p`` really occupies."""
        return payload_nbytes(p, self.te_names)


def program_device(trace: TraceCtx) -> str | None:
    """The CUDA device of the program's first CUDA tensor input, e.g. ``"cuda:0"``; None if it has none."""
    for p in forward_inputs(trace):
        if isinstance(p, TensorProxy) and p.device.type == "cuda":
            return p.device.device_str()
    return None


def program_facts(fw: TraceCtx, bw: TraceCtx, te_names: Set[str] | None = None) -> ProgramFacts:
    """The facts of ``fw`` + ``bw`` (Thunder's augmented forward and its backward); ``te_names``: if the caller has
    them."""
    # and the backward's: a checkpointed block's TE linear forward runs again there (1 byte an element, not bf16's 2)
    te = frozenset(te_quantized_names(fw) if te_names is None else te_names) | te_quantized_names(bw)
    saved, saved_other = forward_saved(fw)
    graph = joint_graph(fw, bw)
    args = tuple(forward_inputs(fw))
    outputs = tuple({p.name: p for p in forward_return(fw)[0]}.values())
    lives = storage_lives(fw, bw, nbytes_of=lambda p: payload_nbytes(p, te), graph=graph)
    model_io = frozenset(p.name for p in (*args, *forward_outputs(fw)))  # the caller keeps them alive
    return ProgramFacts(fw, bw, tuple(saved), tuple(saved_other), args, outputs, model_io, te,
                        graph.graph["backward_start"], program_steps(fw, bw), graph, lives, program_device(fw))
