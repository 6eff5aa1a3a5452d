"""The ranks' collectives at the model's first compilation. Plans depend on per-rank memory, and different plans mean
mismatched collectives (a hang or wrong gradients), so :func:`agree` takes each term's largest bytes and the smallest
budget in one all-reduce MAX, and :func:`differing` compares digests of the ranks' layouts."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from thunder_fp8shard.plan import AGREED, GIVEN, MEASURED, AgreedValue, MemoryTerm, ShardPlan

ABSENT = -(1 << 62)  # a slot this rank does not fill: any other rank's value wins the MAX
MAX_TERMS = 16  # every rank sends this many terms' slots, padded
SHOWN = 3  # differing fields named per rank in the mismatch error


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


class Collectives:
    """The agreement's collectives, torch.distributed's; tests inject a subclass."""

    def size(self, group) -> int:
        return dist.get_world_size(group)

    def ranks(self, group) -> list[int]:
        return dist.get_process_group_ranks(group)

    def all_reduce_max(self, values: Sequence[int], group) -> list[int]:
        """Each slot's largest value over the ranks (a fake group leaves this rank's own)."""
        reduced = torch.tensor(list(values), dtype=torch.int64, device=collective_device(group))
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
        return reduced.tolist()

    def all_gather_digests(self, digest: bytes, group) -> list[bytes]:
        """Every rank's digest, in rank order (a fake group leaves this rank's everywhere)."""
        world_size = self.size(group)
        mine = torch.tensor(list(digest), dtype=torch.uint8, device=collective_device(group))
        everyone = mine.repeat(world_size)  # what a fake group leaves in place
        dist.all_gather_into_tensor(everyone, mine, group=group)
        return [bytes(d.tolist()) for d in everyone.view(world_size, -1).cpu()]

    def all_gather_object(self, obj, group) -> list:
        out: list = [None] * self.size(group)
        dist.all_gather_object(out, obj, group=group)
        return out


TORCH_COLLECTIVES = Collectives()


def agree(terms: Sequence[MemoryTerm], budget_bytes: int | None, group,
          comm: Collectives = TORCH_COLLECTIVES) -> Agreement:
    """The terms and budget every rank of ``group`` plans with (one all-reduce MAX; see :func:`settle`)."""
    if group is None or comm.size(group) < 2:
        return Agreement(tuple(terms), budget_bytes, ())
    return settle(terms, budget_bytes, comm.all_reduce_max(encode(terms, budget_bytes), group))


def largest(values: Sequence[int], group, comm: Collectives = TORCH_COLLECTIVES) -> list[int]:
    """Each of ``values``' largest over the ranks of ``group`` (one all-reduce), so that every rank decides alike."""
    if group is None or comm.size(group) < 2:
        return list(values)
    return [int(v) for v in comm.all_reduce_max(list(values), group)]


def encode(terms: Sequence[MemoryTerm], budget_bytes: int | None) -> list[int]:
    """This rank's slots for the all-reduce MAX: per term its bytes, first step negated and last step, padded to
    :data:`MAX_TERMS`, then the budget negated. Terms whose number can differ between ranks are last and empty."""
    if len(terms) > MAX_TERMS:
        raise ValueError(f"ShardIntermediates: {len(terms)} memory terms, more than the {MAX_TERMS} the agreement sends")
    empty, slots = [0, ABSENT, ABSENT], []
    for t in terms:
        slots += [t.nbytes, -min(s for s, _, _ in t.spans), max(e for _, e, _ in t.spans)] if t.spans else empty
    slots += empty * (MAX_TERMS - len(terms))
    return [*slots, -budget_bytes if budget_bytes is not None else ABSENT]


def settle(terms: Sequence[MemoryTerm], budget_bytes: int | None, reduced: Sequence[int]) -> Agreement:
    """The agreement from the reduced slots: a term of at most one span becomes the largest bytes over any rank's steps
    (``AGREED`` where not this rank's own)."""
    if len(reduced) != 3 * MAX_TERMS + 1 or len(terms) > MAX_TERMS:
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


def collectives(plan: ShardPlan, *, verify: bool) -> list[tuple[str, str]]:
    """What defines the collectives a plan runs, as ``(field, value)`` pairs in a fixed order, without tensor names."""
    nbytes_of = {d.name: d.nbytes for d in plan.decisions}
    op_nbytes = plan.shard_op_nbytes
    fields = [("world size", str(plan.world_size)), ("shard group size", str(plan.k)), ("method", plan.method),
              ("verify", str(verify)), ("process group", plan.comm), ("shard ops", str(len(op_nbytes)))]
    for op, nbytes in sorted(op_nbytes.items()):
        mine = [b for b in plan.buckets if b.shard_op == op]
        fields.append((f"shard op {op}", f"{nbytes:,} B a rank after step {max(b.shard_at for b in mine)}, keeping "
                       f"bucket(s) {', '.join(str(b.index) for b in mine)}"))
    fields.append(("buckets", str(len(plan.buckets))))
    for b in plan.buckets:
        sizes = ", ".join(f"{nbytes_of.get(n, 0):,}" for n in b.members)
        fields.append((f"bucket {b.index}", f"bytes {b.shard_offset:,}-{b.shard_offset + b.shard_nbytes:,} of shard op "
                       f"{b.shard_op}, members of {sizes} B, {b.gathered_nbytes:,} B gathered, issued at step "
                       f"{b.gather_at}, waited before step {b.first_use}" + (f", its shards {len(b.sources)} input(s)" if b.sources else "")))
    order = sorted(plan.buckets, key=lambda b: (b.gather_at, b.index))
    fields.append(("gather order", ", ".join(str(b.index) for b in order) or "-"))
    # a weight gathered in FP8 on one rank and in bf16 on another would hang the forward
    fields += [(f"forward gather {i}", f"{'x'.join(map(str, g.shape))} {'fp8' if g.fp8 else 'bf16'}")
               for i, g in enumerate(getattr(plan, "forward_gather", ()))]
    return fields


def digest(fields: Sequence[tuple[str, str]]) -> bytes:
    """SHA-256 of the fields (32 bytes)."""
    return hashlib.sha256("\n".join(f"{k}: {v}" for k, v in fields).encode()).digest()


def differing(layout, group, comm: Collectives = TORCH_COLLECTIVES) -> list | None:
    """None where every rank agreed the same ``layout`` (one all-gather of digests), else every rank's layout."""
    if group is None or comm.size(group) < 2:
        return None
    digests = comm.all_gather_digests(layout.digest, group)
    return None if all(d == digests[0] for d in digests) else comm.all_gather_object(layout, group)


def mismatch_message(described: Sequence[Sequence[tuple[str, str]]], ranks: Sequence[int]) -> str:
    """The error every rank raises: for each rank whose plan differs from the first's, the first differing fields."""
    first = dict(described[0])
    parts = []
    for r, fields in zip(ranks[1:], described[1:]):
        theirs = dict(fields)
        differ = [k for k in dict.fromkeys([*first, *theirs]) if first.get(k) != theirs.get(k)]
        if not differ:
            continue
        shown = "; ".join(f"{k}: rank {ranks[0]} '{first.get(k, '(none)')}', rank {r} '{theirs.get(k, '(none)')}'"
                          for k in differ[:SHOWN])
        more = f"; and {len(differ) - SHOWN} more field(s)" if len(differ) > SHOWN else ""
        parts.append(f"rank {r} differs from rank {ranks[0]} in {shown}{more}")
    what = ". ".join(parts) or "the digests differ although the descriptions agree"
    return ("ShardIntermediates: the ranks compiled programs with different collectives at the model's first "
            f"compilation, so none of them runs (they would hang, abort or corrupt the gradients). {what}. Neither "
            "rank 0's layout nor sharding nothing makes them the same: the ranks' programs differ beyond the pass "
            "(their own code paths?); the options must be the same on every rank.")
