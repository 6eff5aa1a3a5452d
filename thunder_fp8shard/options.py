"""User options of ``ShardIntermediates``, validated once at construction."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, fields

CANDIDATE_KINDS = ("auto", "fp8", "all")
COMPACTS = ("auto", "off")
SHARD_METHODS = ("slice", "reduce_scatter")
POLICIES = ("all", "peak", "budget")
COMMS = ("shared", "dedicated")


@dataclass(frozen=True)
class ShardOptions:
    """What to shard and how; docs/options.md says each option in full.

    candidates: ``"auto"``: FP8 saved tensors and those whose shard already is an input; ``"fp8"``: FP8 only;
        ``"all"``: every saved tensor.
    min_bytes: smaller candidates (and compactions freeing less) are left alone.
    compact: ``"auto"``: replace saved views keeping a larger storage alive by compact copies; ``"off"``: never.
    method: ``"slice"``: this rank's slice of its copy; ``"reduce_scatter"``: a MAX reduce-scatter of the replicas.
    verify: check at shard time that every rank holds identical bytes.
    policy: ``"all"``: every candidate not raising the predicted peak; ``"peak"``: those lowering it; ``"budget"``:
        the fewest gathered bytes bringing the peak to ``budget_bytes``.
    budget_bytes: the per-rank device peak ``policy="budget"`` aims at.
    prefetch: how many buckets ahead of its use a backward all-gather is issued.
    bucket_bytes: the most payload bytes of one bucket (backward all-gather); 0: one tensor a bucket and a shard op.
    resident_bytes: device bytes alive outside the program all step; None: measured while compiling.
    optimizer_states: optimizer state tensors a trained parameter (they do not exist yet at the first compilation);
        None: left out, and the plan says so.
    loss_bytes: device bytes the loss holds at the backward's start; None: 2 x the forward's floating-point outputs.
    comm: ``"shared"``: the setup's process group; ``"dedicated"``: a second group over the same ranks.
    shard_group_size: keep a 1/k shard over runs of k consecutive ranks.
    group: the process group, for a compilation whose setup names none.
    fp8_forward_gather: under Thunder FSDP with TE's DelayedScaling, all-gather TE linear weights in FP8, bitwise
        identical (:mod:`thunder_fp8shard.rewrite.fp8_gather`).
    reschedule: move Thunder FSDP's collectives where the memory model predicts a lower peak
        (:mod:`thunder_fp8shard.rewrite.collective_schedule`).

    The memory terms may differ between ranks: every rank plans with the largest. The other options must be the same
    on every rank; where they give different collectives, compilation raises.
    """

    candidates: str = "auto"
    min_bytes: int = 1024
    compact: str = "auto"
    method: str = "slice"
    verify: bool = False
    policy: str = "all"
    budget_bytes: int | None = None
    prefetch: int = 1
    bucket_bytes: int = 1 << 30
    comm: str = "shared"
    resident_bytes: int | None = None
    optimizer_states: int | None = None
    loss_bytes: int | None = None
    group: object = None
    shard_group_size: int | None = None
    fp8_forward_gather: bool = False
    reschedule: bool = True

    def __post_init__(self) -> None:
        for name, allowed in (("candidates", CANDIDATE_KINDS), ("compact", COMPACTS), ("method", SHARD_METHODS),
                              ("policy", POLICIES)):
            _one_of(name, getattr(self, name), allowed)
        for name in ("min_bytes", "prefetch", "bucket_bytes"):
            _non_negative_int(name, getattr(self, name))
        _one_of("comm", self.comm, COMMS)
        for name in ("resident_bytes", "optimizer_states", "loss_bytes"):
            if getattr(self, name) is not None:
                _non_negative_int(name, getattr(self, name))
        if self.group is not None:
            import torch.distributed as dist

            if not isinstance(self.group, dist.ProcessGroup):
                raise TypeError(
                    f"ShardIntermediates: group must be a torch.distributed.ProcessGroup (e.g. dist.group.WORLD or "
                    f"mesh.get_group()), got {type(self.group).__name__}"
                )
        if (k := self.shard_group_size) is not None:
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise ValueError(
                    f"ShardIntermediates: shard_group_size must be a positive int (ranks a subgroup), got {k!r}")
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                check_size(k, dist.get_world_size(), "the world")
        for name in ("reschedule", "fp8_forward_gather", "verify"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ShardIntermediates: {name} must be a bool, got {getattr(self, name)!r}")
        if self.policy == "budget":
            if self.budget_bytes is None:
                raise ValueError("ShardIntermediates: policy='budget' needs budget_bytes (per-rank peak in bytes)")
            _non_negative_int("budget_bytes", self.budget_bytes)
            if self.optimizer_states is None:
                raise ValueError(
                    "ShardIntermediates: policy='budget' needs optimizer_states (the optimizer's state tensors per "
                    "trained parameter: Adam, AdamW: 2; SGD with momentum: 1; none, or already in resident_bytes: 0): "
                    "the budget is in device bytes and the optimizer's state is among them, but the pass cannot see it"
                )
        elif self.budget_bytes is not None:
            raise ValueError(f"ShardIntermediates: budget_bytes is only used with policy='budget', not {self.policy!r}")


def _one_of(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"ShardIntermediates: {name} must be one of {allowed}, got {value!r}")


def _non_negative_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"ShardIntermediates: {name} must be a non-negative int, got {value!r}")


def check_size(k: int, n: int, what: str) -> None:
    """Refuses a subgroup size that does not divide ``n``, the ranks of ``what``."""
    if n % k:
        raise ValueError(
            f"ShardIntermediates: shard_group_size={k} does not divide the {n} ranks of {what}, so they cannot be "
            f"partitioned into subgroups of {k} consecutive ranks; use one of "
            f"{[d for d in range(1, n + 1) if n % d == 0]} (or leave it out: the setup's own group)"
        )


OPTION_NAMES = tuple(f.name for f in fields(ShardOptions))


def signature(names: tuple[str, ...] = OPTION_NAMES) -> inspect.Signature:
    """``(self, *, <names>)``: the options as keyword-only parameters with ShardOptions' defaults, for a
    transform's ``__init__(self, **options)``."""
    by_name = {f.name: f for f in fields(ShardOptions)}
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=by_name[n].default,
                                 annotation=by_name[n].type) for n in names]
    return inspect.Signature(params)


def options_from(owner: str, given: dict, names: tuple[str, ...] = OPTION_NAMES) -> ShardOptions:
    """The validated options of ``owner`` from its keyword arguments; a TypeError names every unknown one."""
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise TypeError(f"{owner}: unknown option(s) {unknown}; the options are {list(names)}")
    return ShardOptions(**given)

