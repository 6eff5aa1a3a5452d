"""User options of ``ShardIntermediates``, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass

CANDIDATE_KINDS = ("fp8", "all")
SHARD_METHODS = ("slice", "reduce_scatter")
POLICIES = ("all", "peak", "budget")
COMMS = ("shared", "dedicated")


@dataclass(frozen=True)
class ShardOptions:
    """What to shard and how.

    candidates: ``"fp8"`` considers saved-for-backward tensors with a float8 dtype and TransformerEngine's quantized
        tensors; ``"all"`` considers every saved tensor (the full all-gathered weights Thunder 0.2.6 keeps under ZeRO-3).
    min_bytes: candidates smaller than this (per-tensor scales, tiny biases) are left alone.
    method: ``"slice"`` keeps this rank's slice of the local copy (no communication); ``"reduce_scatter"``
        reduce-scatters the replicas with MAX, which returns the same bytes when they are identical.
    verify: check at shard time that every rank holds identical bytes (one small all-gather of digests per tensor).
    policy: ``"all"`` shards every sound candidate; ``"peak"`` only those that lower the predicted peak;
        ``"budget"`` shards the fewest bytes of all-gather traffic that bring the peak to ``budget_bytes``.
    budget_bytes: per-rank peak target for ``policy="budget"``.
    prefetch: how many buckets ahead of its use each backward all-gather is issued. 0 issues it just before its
        first consumer; k issues it when the k-th previous bucket is first consumed (at most k+1 in flight).
    bucket_bytes: sharded tensors are grouped, in backward order, into buckets of at most this many payload bytes
        (a bucket holds at least one tensor): one shard op in forward, one all-gather in backward per bucket, fewer
        operators for the CPU to run. 0 (the default) gives one bucket per tensor: on the GPU, 256 MiB buckets cost
        0.19 GB of the 3.18 GB saved on Llama-2-7b (more bytes gathered at once at the start of the backward).
    comm: ``"shared"`` (the default) sends the shards over the setup's process group (FSDP's or DDP's);
        ``"dedicated"`` over a second group with the same ranks (created once, at the first compilation), so the
        all-gathers run on their own NCCL communicator and stream and cannot queue behind FSDP's gradient
        reduce-scatters (profiled on the GPU, they did not: the backward's compute stream had no such waits).
    group: a ``torch.distributed.ProcessGroup``, for a compilation whose setup names no process group (a ThunderFX
        subgraph without FSDP2 parameters: nothing is sharded there, and the plan says so). Where the setup names its
        group (Thunder FSDP/DDP, FSDP2's shard group), ``group=`` may be given but must span the same ranks (checked
        when compiling); the setup's group is used.
    """

    candidates: str = "fp8"
    min_bytes: int = 1024
    method: str = "slice"
    verify: bool = False
    policy: str = "all"
    budget_bytes: int | None = None
    prefetch: int = 1
    bucket_bytes: int = 0
    comm: str = "shared"
    group: object = None

    def __post_init__(self) -> None:
        _one_of("candidates", self.candidates, CANDIDATE_KINDS)
        _one_of("method", self.method, SHARD_METHODS)
        _one_of("policy", self.policy, POLICIES)
        _non_negative_int("min_bytes", self.min_bytes)
        _non_negative_int("prefetch", self.prefetch)
        _non_negative_int("bucket_bytes", self.bucket_bytes)
        _one_of("comm", self.comm, COMMS)
        if self.group is not None:
            import torch.distributed as dist

            if not isinstance(self.group, dist.ProcessGroup):
                raise TypeError(
                    f"ShardIntermediates: group must be a torch.distributed.ProcessGroup (e.g. dist.group.WORLD or "
                    f"mesh.get_group()), got {type(self.group).__name__}"
                )
        if not isinstance(self.verify, bool):
            raise TypeError(f"ShardIntermediates: verify must be a bool, got {self.verify!r}")
        if self.policy == "budget":
            if self.budget_bytes is None:
                raise ValueError("ShardIntermediates: policy='budget' needs budget_bytes (per-rank peak in bytes)")
            _non_negative_int("budget_bytes", self.budget_bytes)
        elif self.budget_bytes is not None:
            raise ValueError(f"ShardIntermediates: budget_bytes is only used with policy='budget', not {self.policy!r}")


def _one_of(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"ShardIntermediates: {name} must be one of {allowed}, got {value!r}")


def _non_negative_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"ShardIntermediates: {name} must be a non-negative int, got {value!r}")
