"""Every rank compiles the same collectives: the plan's per-rank inputs are agreed across the ranks before planning.

A plan is a pure function of the program (the same traces on every rank), the options and the memory the step runs
in besides the program (:mod:`thunder_fp8shard.resident`). That memory can differ between ranks: what each rank's
device allocator holds while compiling (:mod:`thunder_fp8shard.device_memory`), and ``resident_bytes``,
``loss_bytes`` or ``optimizer_states`` where a user passes rank-dependent values; so can ``budget_bytes``. The
grouping's headroom rule and the ``peak``/``budget`` policies turn such differences into different buckets, i.e.
collectives of different sizes on different ranks: a gloo abort, over NCCL a hang or wrong bytes in the gradients.

:func:`agree` therefore takes, in one all-reduce MAX over the setup's process group, each memory term's largest
bytes over the ranks (every rank plans for the fullest device) and the smallest ``budget_bytes`` (the tightest
target). The plan is then the same on every rank by construction. Every rank compiles the same programs in the same
order (under ThunderFX one subgraph at a time, in the same order), so each compilation's all-reduce is matched.

Collectives run on the device the group's backend needs: the current CUDA device for NCCL, the CPU otherwise (gloo,
and torch's fake process group, whose collectives return at once without writing: the agreed values are then this
rank's own).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from thunder_fp8shard.plan import AGREED, GIVEN, MEASURED, AgreedValue, MemoryTerm

ABSENT = -(1 << 62)  # a slot this rank does not fill: every MAX takes any other rank's value over it


@dataclass(frozen=True)
class Agreement:
    """What every rank plans with, and (``values``, for the plan) what was agreed against this rank's own."""

    terms: tuple[MemoryTerm, ...]
    budget_bytes: int | None
    values: tuple[AgreedValue, ...]


def collective_device(group) -> torch.device:
    """Where ``group``'s collectives take their tensors: the current CUDA device under NCCL, else the CPU."""
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(terms: Sequence[MemoryTerm], budget_bytes: int | None, group) -> Agreement:
    """The terms and the budget every rank of ``group`` plans with (one all-reduce MAX of :func:`encode`'s vector;
    see :func:`settle`). With one rank there is nothing to agree."""
    world_size = dist.get_world_size(group)
    if world_size < 2:
        return Agreement(tuple(terms), budget_bytes, ())
    reduced = torch.tensor(encode(terms, budget_bytes), dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)  # in place: a fake group leaves this rank's own
    return settle(terms, budget_bytes, reduced.tolist())


def encode(terms: Sequence[MemoryTerm], budget_bytes: int | None) -> list[int]:
    """This rank's slots for the all-reduce MAX: for each term its bytes, its first step negated and its last step
    (``ABSENT`` for a term without spans), then the budget negated (MAX of the negated values is the smallest).

    Its length is ``3 * len(terms) + 1`` on every rank: :func:`thunder_fp8shard.resident.step_terms` gives the same
    terms in the same order whatever was measured or given."""
    slots = []
    for t in terms:
        if t.spans:
            slots += [t.nbytes, -min(s for s, _, _ in t.spans), max(e for _, e, _ in t.spans)]
        else:
            slots += [0, ABSENT, ABSENT]
    return [*slots, -budget_bytes if budget_bytes is not None else ABSENT]


def settle(terms: Sequence[MemoryTerm], budget_bytes: int | None, reduced: Sequence[int]) -> Agreement:
    """The agreement from the reduced slots (pure). A term of at most one span (resident at the call, persistent
    workspaces, loss, optimizer state) becomes one span of the largest bytes over the steps any rank put it on;
    where that is not this rank's own, its source becomes ``AGREED``. A term of several spans is modelled from the
    program's steps alone, the same on every rank, and is kept. The plan
    lists the terms measured or given on this rank, those another rank raised, and the budget."""
    if len(reduced) != 3 * len(terms) + 1:
        raise ValueError(f"ShardIntermediates: {len(reduced)} agreed slots for {len(terms)} memory terms")
    out, values = [], []
    for k, t in enumerate(terms):
        nbytes, first, last = reduced[3 * k], -reduced[3 * k + 1], reduced[3 * k + 2]
        agreed = t
        if len(t.spans) <= 1 and nbytes and ((first, last, nbytes),) != t.spans:
            agreed = MemoryTerm(t.name, AGREED, f"{t.how} ({t.nbytes:,} B on this rank): planned with the largest "
                                "over the ranks", ((first, last, nbytes),))
        if agreed is not t or t.source in (MEASURED, GIVEN):
            values.append(AgreedValue(t.name, agreed.nbytes, t.nbytes, "largest"))
        out.append(agreed)
    budget = -reduced[-1] if budget_bytes is not None else None  # a rank without a budget plans without one
    if budget is not None:
        values.append(AgreedValue("budget_bytes", budget, budget_bytes, "smallest"))
    return Agreement(tuple(out), budget, tuple(values))
