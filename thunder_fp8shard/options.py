"""User options of ``ShardIntermediates``, validated once at construction."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, fields

CANDIDATE_KINDS = ("fp8", "all")
COMPACTS = ("auto", "off")
SHARD_METHODS = ("slice", "reduce_scatter")
POLICIES = ("all", "peak", "budget")
COMMS = ("shared", "dedicated")


@dataclass(frozen=True)
class ShardOptions:
    """What to shard and how.

    candidates: ``"fp8"`` considers saved-for-backward tensors with a float8 dtype and TransformerEngine's quantized
        tensors; ``"all"`` considers every saved tensor (the full all-gathered weights Thunder 0.2.6 keeps under ZeRO-3).
    min_bytes: candidates smaller than this (per-tensor scales, tiny biases) are left alone, and so are compactions
        that would free fewer bytes.
    compact: ``"auto"`` replaces a saved view that keeps a larger storage alive (LitGPT's ``v``, a view of ``qkv``
        out of a torch.compile region) by a compact copy of itself, made right after the storage's last forward use
        (rank-local, no communication, exact; see :mod:`thunder_fp8shard.analysis.compaction`), where the copy frees at
        least as many bytes as it copies: under policy ``"all"`` every such one, under ``"peak"`` and ``"budget"``
        those the policy picks, weighed with the shards by the bytes each moves a step. ``"off"``: never.
    method: ``"slice"`` keeps this rank's slice of the local copy (no communication); ``"reduce_scatter"``
        reduce-scatters the replicas with MAX, which returns the same bytes when they are identical.
    verify: check at shard time that every rank holds identical bytes (one small all-gather of digests per tensor).
    policy: ``"all"`` shards every sound candidate; ``"peak"`` only those that lower the predicted peak;
        ``"budget"`` shards the fewest bytes of all-gather traffic that bring the peak to ``budget_bytes`` (it needs
        ``optimizer_states``).
    budget_bytes: per-rank peak target for ``policy="budget"``, in device bytes: what
        ``torch.cuda.max_memory_allocated`` will read, i.e. the program plus the memory the step runs in (the
        terms of :mod:`thunder_fp8shard.memory.resident`), not the program's bytes alone. Where ranks give different
        budgets, every rank plans for the smallest (see :mod:`thunder_fp8shard.distributed.agreement`).
    prefetch: how many buckets ahead of its use each backward all-gather is issued. 0 issues it just before its
        first consumer; k issues it when the k-th previous bucket is first consumed (at most k+1 in flight).
    bucket_bytes: the most payload bytes one backward all-gather (a bucket) or one forward shard op handles.
        Tensors are taken in order of first backward use; each joins the current bucket, or else the current shard
        op, only where the memory model predicts that the step stays at least 5% below its predicted peak wherever the
        grouping holds more bytes (see :mod:`thunder_fp8shard.planning.grouping`): buckets stay one tensor near the
        backward's peak and grow to whole layers further on, so the step runs fewer operators. 0 gives one tensor a
        bucket and a shard op. Default 1 GiB: the headroom rule, not the cap, bounds the groups near the peak, and
        elsewhere larger groups mean fewer operator calls (benchmarks/README.md has the measurements).
    resident_bytes: device bytes alive during the whole step outside the program and its inputs (optimizer state,
        other models). None (the default): measured on the device while the first call compiles (on the CPU: not
        counted); an int replaces that measurement.
    optimizer_states: the optimizer's state tensors per trained parameter, each the size of its local shard (Adam,
        AdamW: 2; SGD with momentum: 1), counted on top of the measured resident bytes: the optimizer creates them
        at its first step, after the first call compiled. None (the default): unknown; the predicted peak leaves
        them out and the plan's headline says so, with what Adam/AdamW would add (the pass cannot see the optimizer:
        it is the caller's object, outside every trace, and its state does not exist yet when the first call
        compiles). 0: no optimizer state, or it is already counted: in ``resident_bytes``, or in the resident
        measurement of a compilation after the optimizer's first step (a new input shape), which holds it.
        ``policy="budget"`` needs it given.
    loss_bytes: device bytes the loss computed outside the program holds at the start of the backward. None (the
        default): 2 x the forward's floating-point outputs (a cross-entropy on them).

    ``resident_bytes``, ``optimizer_states`` and ``loss_bytes`` may differ between ranks, as may what each rank
    measures: every rank plans with each memory term's largest value over the ranks (agreed while compiling, see
    :mod:`thunder_fp8shard.distributed.agreement`), so all plan the same collectives. The other options must be the same on every
    rank; where they give different collectives, compilation raises on every rank, naming what differs.
    comm: ``"shared"`` (the default) sends the shards over the setup's process group (FSDP's or DDP's);
        ``"dedicated"`` over a second group with the same ranks (created once, at the first compilation), so the
        all-gathers run on their own NCCL communicator and stream and cannot queue behind FSDP's gradient
        reduce-scatters (profiled on the GPU, they did not: the backward's compute stream had no such waits).
    shard_group_size: shard over subgroups of this many consecutive ranks instead of the setup's whole group: the
        setup's ranks (those its replicated values are identical on, in order; under FSDP2 HSDP the whole mesh) are
        partitioned into runs of ``shard_group_size`` and each rank keeps a 1/k shard over its own run, so it saves
        (k-1)/k of each copy instead of (N-1)/N, and its backward all-gathers stay within k ranks (a node, when k is
        the GPUs a node). Exactly as sound: identical on every rank of the group means identical on every rank of a
        subgroup. None (the default): the setup's own group (FSDP's or DDP's whole group; FSDP2's shard group, under
        HSDP the mesh's shard dimension). It must divide the setup's number of ranks: refused here when it cannot
        divide the world size (when the process group is already initialized: every supported setup spans the world
        or a mesh whose size divides it), else when compiling. A size equal to the setup's own group's is that
        group (``comm`` applies as without the option); any other travels on subgroups the pass creates
        collectively, once, at the first compilation (see :mod:`thunder_fp8shard.distributed.shard_groups`), which are its own
        groups already: ``comm`` has no further effect there.
    group: a ``torch.distributed.ProcessGroup``, for a compilation whose setup names no process group (a ThunderFX
        subgraph without FSDP2 parameters: nothing is sharded there, and the plan says so). Where the setup names its
        group (Thunder FSDP/DDP, FSDP2's shard group), ``group=`` may be given but must span the same ranks (checked
        when compiling); the setup's group is used.
    fp8_forward_gather: on by default. Under Thunder FSDP with TransformerEngine's
        DelayedScaling (``reduce_amax=True``), each TE linear weight whose only use is that linear is cast to FP8 on
        its own rows by each rank and all-gathered as uint8, instead of all-gathered in bf16 and cast whole by every
        rank: half the forward all-gather bytes, 1/N of the cast. Bitwise identical (the cast is
        elementwise with a scale fixed before it; the weight's amax is the MAX all-reduce of the shards' amaxes;
        see ``docs/fp8_forward_gather.md`` and :mod:`thunder_fp8shard.rewrite.fp8_gather`); every weight it cannot prove that
        for keeps its bf16 gather, with the reason in the plan; elsewhere (no TE linear, another setup) it does nothing.
    """

    candidates: str = "fp8"
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
    fp8_forward_gather: bool = True

    def __post_init__(self) -> None:
        _one_of("candidates", self.candidates, CANDIDATE_KINDS)
        _one_of("compact", self.compact, COMPACTS)
        _one_of("method", self.method, SHARD_METHODS)
        _one_of("policy", self.policy, POLICIES)
        _non_negative_int("min_bytes", self.min_bytes)
        _non_negative_int("prefetch", self.prefetch)
        _non_negative_int("bucket_bytes", self.bucket_bytes)
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
        if self.shard_group_size is not None:
            _shard_group_size(self.shard_group_size)
        if not isinstance(self.fp8_forward_gather, bool):
            raise TypeError(f"ShardIntermediates: fp8_forward_gather must be a bool, got {self.fp8_forward_gather!r}")
        if not isinstance(self.verify, bool):
            raise TypeError(f"ShardIntermediates: verify must be a bool, got {self.verify!r}")
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


def _shard_group_size(k: object) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"ShardIntermediates: shard_group_size must be a positive int (ranks a subgroup), got {k!r}")
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from thunder_fp8shard.distributed.shard_groups import check_size

        check_size(k, dist.get_world_size(), "the world")


OPTION_NAMES = tuple(f.name for f in fields(ShardOptions))


def signature(names: tuple[str, ...] = OPTION_NAMES) -> inspect.Signature:
    """``(self, *, <names>)``: the options as keyword-only parameters with ShardOptions' defaults and types, for a
    transform's ``__init__(self, **options)`` (``inspect.signature`` and ``help()`` show it)."""
    by_name = {f.name: f for f in fields(ShardOptions)}
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=by_name[n].default,
                                 annotation=by_name[n].type) for n in names]
    return inspect.Signature(params)


def options_from(owner: str, given: dict, names: tuple[str, ...] = OPTION_NAMES) -> ShardOptions:
    """The validated options of ``owner`` (a transform's name) from its keyword arguments, every one of which must be
    among ``names``: a TypeError names every unknown one and lists the options (Python's own names one)."""
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise TypeError(f"{owner}: unknown option(s) {unknown}; the options are {list(names)}")
    return ShardOptions(**given)

