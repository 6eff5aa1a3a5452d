"""Thunder FSDP's gather of a parameter in the forward, found by one rule: an all-gather, the wait on its handle, and
the slice that unpads the gathered tensor. Own shards, the FP8 forward gather and reschedule read these chains and
each applies its own conditions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from thunder.core.proxies import TensorProxy
from thunder.core.symbol import BoundSymbol

from thunder_fp8shard.analysis.liveness import readers
from thunder_fp8shard.analysis.names import ALL_GATHER, SLICE, WAIT


@dataclass(frozen=True)
class Gather:
    """An all-gather and the first wait on its handle. ``handle_users`` and ``gathered_users``: every bound symbol
    reading the handle, or the wait's output; ``unpad``: the wait output's only reader where it is a slice;
    ``first_use``: the position of the first reader of the weight (the unpad's output, else the wait's), None where it
    has none. Positions are in the forward without its dels."""

    gather: BoundSymbol
    wait: BoundSymbol
    handle_users: tuple[BoundSymbol, ...]
    gathered_users: tuple[BoundSymbol, ...]
    unpad: BoundSymbol | None
    first_use: int | None
    at: int  # the all-gather's position in the forward without its dels
    wait_at: int

    @property
    def shard(self):
        """What is all-gathered (under FSDP a parameter's shard, a trace input)."""
        return self.gather.args[0]

    @property
    def group(self):
        return self.gather.args[1]

    @property
    def dim(self):
        return self.gather.args[3] if len(self.gather.args) > 3 else None

    @property
    def gathered(self) -> TensorProxy:
        return self.wait.output

    @property
    def slices(self) -> tuple[BoundSymbol, ...]:
        """The slices reading the gathered tensor (its unpad among them)."""
        return tuple(b for b in self.gathered_users if b.sym.name == SLICE)

    @property
    def waited_alone(self) -> bool:
        """Whether the handle's only reader is the wait."""
        return self.handle_users == (self.wait,)


def forward_gathers(body: Sequence[BoundSymbol]) -> tuple[Gather, ...]:
    """Every all-gather of a forward's ``body`` (without its dels: ``ProgramFacts.body``) whose handle is waited for,
    in trace order."""
    read = readers(body)
    position = {id(b): i for i, b in enumerate(body)}
    out = []
    for g in body:
        outs = g.flat_proxy_outs
        if g.sym.name != ALL_GATHER or len(outs) != 1:
            continue
        handle_users = tuple(body[i] for i in read.get(outs[0].name, ()))
        wait = next((b for b in handle_users if b.sym.name == WAIT and b.args
                     and getattr(b.args[0], "name", None) == outs[0].name), None)
        if wait is None or not isinstance(wait.output, TensorProxy):
            continue
        gathered_users = tuple(body[i] for i in read.get(wait.output.name, ()))
        unpad = gathered_users[0] if len(gathered_users) == 1 and gathered_users[0].sym.name == SLICE else None
        weight = unpad.output if unpad is not None else wait.output
        uses = read.get(weight.name, []) if isinstance(weight, TensorProxy) else []
        out.append(Gather(g, wait, handle_users, gathered_users, unpad, min(uses) if uses else None, position[id(g)],
                          position[id(wait)]))
    return tuple(out)
