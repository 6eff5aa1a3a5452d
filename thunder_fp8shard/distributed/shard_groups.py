"""The process group the shards travel on: the setup's own, a second one over its ranks, or a subgroup.

A setup (see :mod:`thunder_fp8shard.distributed.integrations`) names the ranks its replicated values are identical on (FSDP's or
DDP's group; under FSDP2 HSDP the whole 2-D mesh) and its own group for the shards (the same group; under HSDP the
mesh's shard dimension). By default each rank keeps a 1/N shard over that group (``comm="shared"``), or over a second
group with the same ranks (``comm="dedicated"``: its own communicator and stream).

With ``shard_group_size=k`` the setup's ranks, in their order, are partitioned into subgroups of ``k`` consecutive
ranks, and each rank keeps a 1/k shard over its own subgroup. A tensor identical on every rank of the setup's group is
identical on every rank of any subgroup of it, so this is exactly as sound; it keeps (k-1)/k of each copy's bytes off
the rank instead of (N-1)/N, and the backward all-gathers stay within k ranks (within a node when k is the number of
GPUs a node and ranks are numbered node by node, as torchrun does).

Creating process groups is collective: every rank of the default group must create the same groups in the same
order. The pass creates a partition once per setup (at its first compilation: every rank compiles the same programs
in the same order), all of its subgroups on every rank (``torch.distributed.new_subgroups_by_enumeration``), and
reuses it for every later compilation over the same ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from thunder_fp8shard.options import check_size


@dataclass(frozen=True)
class ShardGroup:
    """Where this rank's shards live and travel."""

    group: object  # the process group of the all-gathers (and of the shard op's reduce-scatter or digest check)
    ranks: tuple[int, ...]  # its global ranks, in group order: this rank keeps the shard at its index among them
    origin: str  # "own": the setup's group; "dedicated": a second group over its ranks (comm="dedicated");
    # "partition": this rank's run of a partition the pass made (shard_group_size)

    @property
    def size(self) -> int:
        return len(self.ranks)


def partition(ranks: tuple[int, ...], k: int, what: str = "the setup's group") -> list[tuple[int, ...]]:
    """``ranks`` cut into consecutive runs of ``k``."""
    check_size(k, len(ranks), what)
    return [tuple(ranks[i : i + k]) for i in range(0, len(ranks), k)]


class ShardGroups:
    """Creates, once, and then reuses the groups the shards travel on (one instance per ``ShardIntermediates``)."""

    def __init__(self, comm: str, size: int | None):
        self.comm, self.size = comm, size
        self._made: dict[tuple, object] = {}

    def for_setup(self, own_group, ranks: tuple[int, ...], what: str) -> ShardGroup:
        """The shard group of this rank. ``own_group``: the setup's group for the shards; ``ranks``: the global ranks
        the replicated values are identical on (``own_group``'s, or under FSDP2 HSDP the whole mesh, of which
        ``own_group`` is a run); ``what``: the setup, for errors."""
        own_ranks = tuple(dist.get_process_group_ranks(own_group))
        k = self.size or len(own_ranks)
        if k == len(own_ranks) and self.comm == "shared":
            return ShardGroup(own_group, own_ranks, "own")
        chunks = tuple(partition(ranks, k, what))
        me = dist.get_rank()
        mine = next(c for c in chunks if me in c)
        if k != len(own_ranks):
            return ShardGroup(self._new(chunks, own_group), mine, "partition")
        if mine != own_ranks:  # every rank must create the same groups: mirror the setup's as a run of its ranks
            raise RuntimeError(
                f"ShardIntermediates: comm='dedicated' needs {what}'s group (ranks {list(own_ranks)}) to be a run of "
                f"consecutive ranks of {list(ranks)}; use comm='shared'"
            )
        return ShardGroup(self._new(chunks, own_group), mine, "dedicated")

    def _new(self, chunks: tuple[tuple[int, ...], ...], like):
        """This rank's group of a partition into ``chunks``: all of them are created, collectively, the first time
        (``new_subgroups_by_enumeration`` calls ``new_group`` for each, in order, on every rank)."""
        if chunks not in self._made:
            mine, _ = dist.new_subgroups_by_enumeration([list(c) for c in chunks], backend=dist.get_backend(like),
                                                      group_desc="fp8shard_shards")
            self._made[chunks] = mine
        return self._made[chunks]
