"""The process group the shards travel on: the setup's own (``comm="shared"``), a second one over its ranks
(``"dedicated"``), or with ``shard_group_size=k`` this rank's run of ``k`` consecutive ranks. A tensor identical on a
group is identical on any subgroup, so a subgroup is as sound. Creating groups is collective: every rank creates all
subgroups of a partition once, in the same order, at the setup's first compilation."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from thunder_fp8shard.options import check_size


@dataclass(frozen=True)
class ShardGroup:
    """Where this rank's shards live and travel."""

    group: object  # of the all-gathers, and of the shard op's reduce-scatter or digest check
    ranks: tuple[int, ...]  # global ranks in group order: this rank keeps the shard at its index
    origin: str  # "own": the setup's group; "dedicated": a second group over its ranks; "partition": a subgroup

    @property
    def size(self) -> int:
        return len(self.ranks)


def partition(ranks: tuple[int, ...], k: int, what: str = "the setup's group") -> list[tuple[int, ...]]:
    """``ranks`` cut into consecutive runs of ``k``."""
    check_size(k, len(ranks), what)
    return [tuple(ranks[i : i + k]) for i in range(0, len(ranks), k)]


class ShardGroups:
    """Creates once, then reuses, the groups the shards travel on (one instance per ``ShardIntermediates``)."""

    def __init__(self, comm: str, size: int | None):
        self.comm, self.size = comm, size
        self._made: dict[tuple, object] = {}

    def for_setup(self, own_group, ranks: tuple[int, ...], what: str) -> ShardGroup:
        """This rank's shard group. ``ranks``: the global ranks replicated values are identical on; ``what``: for
        errors."""
        own_ranks = tuple(dist.get_process_group_ranks(own_group))
        k = self.size or len(own_ranks)
        if k == len(own_ranks) and self.comm == "shared":
            return ShardGroup(own_group, own_ranks, "own")
        chunks = tuple(partition(ranks, k, what))
        mine = next(c for c in chunks if dist.get_rank() in c)
        if k != len(own_ranks):
            return ShardGroup(self._new(chunks, own_group), mine, "partition")
        if mine != own_ranks:  # every rank must create the same groups
            raise RuntimeError(
                f"ShardIntermediates: comm='dedicated' needs {what}'s group (ranks {list(own_ranks)}) to be a run of "
                f"consecutive ranks of {list(ranks)}; use comm='shared'"
            )
        return ShardGroup(self._new(chunks, own_group), mine, "dedicated")

    def _new(self, chunks: tuple[tuple[int, ...], ...], like):
        """This rank's group of a partition into ``chunks``, all created collectively the first time."""
        if chunks not in self._made:
            self._made[chunks], _ = dist.new_subgroups_by_enumeration(
                [list(c) for c in chunks], backend=dist.get_backend(like), group_desc="fp8shard_shards")
        return self._made[chunks]
