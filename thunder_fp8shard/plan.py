"""The plan: plain, immutable data saying, for every candidate, whether it is sharded and why, and what that is
predicted to save. :func:`~thunder_fp8shard.pipeline.compile_plan` makes it once; nothing changes it afterwards
(what the run-time checks observe goes to a :class:`~thunder_fp8shard.runtime.run_report.RunReport` of its own).
How it reads: :mod:`thunder_fp8shard.reporting.plan_text` (its text) and :mod:`thunder_fp8shard.reporting.plot`
(its predicted memory timelines).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields


@dataclass(frozen=True)
class Step:
    """One position on the joint timeline."""

    index: int  # 0..n-1 over forward bound symbols then backward bound symbols
    phase: str  # "forward" or "backward"
    label: str  # short text, e.g. "t387 = torch.nn.functional.linear" or "del t12"


@dataclass(frozen=True)
class Timeline:
    """Bytes live at each step: after the step's outputs are allocated, before anything is freed."""

    steps: tuple[Step, ...]
    live_bytes: tuple[int, ...]
    backward_start: int  # index of the first backward step (len(steps) when there is no backward)

    @property
    def peak_bytes(self) -> int:
        return max(self.live_bytes, default=0)

    @property
    def peak_step(self) -> Step:
        """The first step where the peak is reached."""
        return self.steps[self.live_bytes.index(self.peak_bytes)]


@dataclass(frozen=True)
class Decision:
    """One candidate: a saved-for-backward tensor of the forward trace. Byte counts are per rank."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str  # "float8", "te_float8" or "tensor" (see thunder_fp8shard.analysis.candidates)
    nbytes: int  # real payload bytes (1 per element for TransformerEngine FP8 tensors, whatever the proxy prints)
    replicated: bool
    sharded: bool
    reason: str
    shard_nbytes: int = 0  # bytes kept per rank when sharded (ceil(nbytes / shard group size))
    # bytes of the storage it views, what sharding frees (a view, e.g. an expand, can be larger or smaller than its
    # storage); 0: unknown, taken as ``nbytes``
    storage_nbytes: int = 0
    # the forward input whose bytes are this rank's shard (a parameter shard Thunder FSDP all-gathered it from, see
    # thunder_fp8shard.analysis.own_shards): nothing is copied or kept but that input, which the caller keeps anyway
    shard_source: str = ""

    @property
    def bytes_saved(self) -> int:
        """The storage's bytes freed less the shard kept (none where the shard is an input): what sharding saves
        this rank."""
        if not self.sharded:
            return 0
        return (self.storage_nbytes or self.nbytes) - (0 if self.shard_source else self.shard_nbytes)


@dataclass(frozen=True)
class Compaction:
    """A storage that only saved views smaller than it keep alive from forward to backward (LitGPT's ``v``, a view of
    its ``qkv`` out of a torch.compile region, see :mod:`thunder_fp8shard.analysis.aliasing`): each saved view can be
    replaced by a compact copy of itself right after the storage's last forward use, which frees the rest. Rank-local
    (no communication), bitwise exact (the copy keeps the view's values and dimension order). Steps are those of the
    unmodified joint program; byte counts are per rank."""

    storage: str  # the storage's first tensor (its base), as the memory model names it
    members: tuple[str, ...]  # the saved views of it
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    member_nbytes: tuple[int, ...]  # each view's own bytes: what its compact copy holds
    storage_nbytes: int
    compact_at: int  # the copies are made right after this step: the last forward use of any tensor viewing the
    # storage, or a later step the planner moved them to (``moved_from``), where the memory model says the predicted
    # peak does not rise: a shard op's (``shard_op``), or that of later compactions made in the same call
    ends: tuple[int, ...]  # the last step each copy is held to (its last use, or that of a view of it)
    compacted: bool = False
    reason: str = ""
    shard_op: int | None = None  # the shard op whose call makes the copies (None: an fp8shard_compact call, with
    # every other compaction made at the same step)
    moved_from: int | None = None  # the last forward use of the storage's views, where the copies were moved from

    @property
    def copied_bytes(self) -> int:
        """Bytes copied a step (the compact copies), and held instead of the storage."""
        return sum(self.member_nbytes)

    @property
    def freed_bytes(self) -> int:
        """Bytes of the storage no longer held from ``compact_at`` to the views' backward uses."""
        return self.storage_nbytes - self.copied_bytes


MEASURED = "measured"  # read from the device while the first call compiled
MODELLED = "modelled"  # by a rule from the traces and the options
GIVEN = "given"  # an option the user set
NOT_COUNTED = "not counted"  # known to exist but 0 here (nothing to measure on this device, or no rule)
UNKNOWN = "unknown"  # present in the step but of unknown size: left out of the predicted peak, the headline says so
AGREED = "agreed"  # another rank's value, larger than this rank's own (see thunder_fp8shard.distributed.agreement)


@dataclass(frozen=True)
class MemoryTerm:
    """Device memory of the step besides the jitted program's own tensors (see :mod:`thunder_fp8shard.memory.resident`),
    laid on the joint timeline as ``spans``: ``(first step, last step, bytes)``, inclusive. Per rank."""

    name: str  # e.g. "optimizer state"
    source: str  # MEASURED, MODELLED, GIVEN, NOT_COUNTED, UNKNOWN, or AGREED where another rank's value replaced this rank's
    how: str  # one line: what was measured, or the rule
    spans: tuple[tuple[int, int, int], ...] = ()

    @property
    def nbytes(self) -> int:
        """The most bytes this term holds at any one step."""
        return max((sum(b for s, e, b in self.spans if s <= at <= e) for at, _, _ in self.spans), default=0)

    def where(self, n_steps: int) -> str:
        """The steps it covers, in words."""
        if not self.spans:
            return "-"
        first, last = min(s for s, _, _ in self.spans), max(e for _, e, _ in self.spans)
        return "every step" if (first, last) == (0, n_steps - 1) else f"steps {first}-{last}"


@dataclass(frozen=True)
class AgreedValue:
    """A plan input that can differ between ranks, as every rank planned with it (see
    :mod:`thunder_fp8shard.distributed.agreement`): a memory term's bytes (the largest over the ranks) or ``budget_bytes`` (the
    smallest)."""

    name: str  # a MemoryTerm's name, or "budget_bytes"
    value: int  # what every rank planned with
    own: int  # this rank's own value
    rule: str  # "largest" or "smallest"


@dataclass(frozen=True)
class Bucket:
    """Sharded tensors kept as one shard and all-gathered back as one buffer. Steps are those of the unmodified
    joint program (see :mod:`thunder_fp8shard.analysis.liveness`); byte counts are per rank."""

    index: int
    members: tuple[str, ...]  # in order of first backward use
    nbytes: int  # the members' payload bytes
    shard_nbytes: int  # bytes this rank keeps (the layout, alignment included, over the world size)
    gathered_nbytes: int  # bytes of the all-gathered buffer
    shard_at: int  # the last forward use of any member; the shard is taken right after
    gather_at: int  # where its all-gather is issued
    first_use: int  # the first backward use of any member; the wait is right before
    shard_op: int = 0  # index of the forward shard op that keeps this bucket's shard (one op can serve several)
    shard_offset: int = 0  # where this bucket's shard starts in that op's output (bytes)
    shard_until: int | None = None  # last step that op's shard is held: the wait of its last bucket
    # the forward inputs that are this rank's shards of its members (Decision.shard_source), one each: no shard op
    # call, no bytes kept; one coalesced all-gather of them; the bucket is its own "shard op" (``shard_op``, never
    # shared). Empty: a shard op's bucket
    sources: tuple[str, ...] = ()


@dataclass(frozen=True)
class ForwardGather:
    """One TE linear weight's forward all-gather (``fp8_forward_gather``, see :mod:`thunder_fp8shard.rewrite.fp8_gather`):
    gathered in FP8 (this rank casts its own rows, then the uint8 bytes are all-gathered) or left in bf16, and why.
    Bytes are per rank, one execution: received = (N-1)/N of the gathered buffer."""

    weight: str  # the trace input (this rank's parameter shard)
    shape: tuple[int, ...]  # the full (unpadded) weight
    fp8: bool
    reason: str
    received_bytes_before: int  # the bf16 all-gather's
    received_bytes_after: int  # the uint8 all-gather's where fp8, else as before
    cast_elements_before: int  # weight elements this rank casts to FP8: the full weight (TE's own cast)
    cast_elements_after: int  # its valid rows where fp8


@dataclass(frozen=True)
class BudgetTraffic:
    """Policy "budget": the bytes the choice moves a step (shards' payloads, compactions' copies) and a lower bound on
    what any choice meeting the target must move (None: no choice meets it; see
    :func:`thunder_fp8shard.planning.planner.least_traffic`)."""

    moved_bytes: int
    lower_bound_bytes: int | None


@dataclass(frozen=True)
class ShardPlan:
    """What the pass decided for one compiled cache entry (forward trace + backward trace), made once at compile
    time and never changed (frozen; its sequences are tuples)."""

    world_size: int  # ranks of the setup's group (under FSDP2 HSDP, of the whole mesh)
    method: str
    policy: str
    prefetch: int
    decisions: tuple[Decision, ...]
    saved_bytes_before: int  # per rank, each storage once, as saved_tensors_hooks sees them
    saved_bytes_after: int
    peak_bytes_before: int | None = None  # predicted per-rank device peak: the joint program plus ``terms``
    peak_bytes_after: int | None = None
    program_peak_bytes_before: int | None = None  # the joint forward+backward program's own tensors only
    program_peak_bytes_after: int | None = None
    terms: tuple[MemoryTerm, ...] = ()  # memory of the step outside the program, per source
    timeline_before: Timeline | None = None
    timeline_after: Timeline | None = None
    buckets: tuple[Bucket, ...] = ()
    bucket_bytes: int = 0
    comm: str = ""  # the process group the shards travel on: "shared" (the setup's own) or "dedicated"
    integration: str = ""  # the distributed setup the pass recognized, e.g. "Thunder FSDP (ZeRO-3)"
    pass_seconds: float = 0.0  # wall time of both hooks of the pass (analysis, plan, rewrite) for this entry
    agreed: tuple[AgreedValue, ...] = ()  # the per-rank inputs agreed across the ranks
    notes: tuple[str, ...] = ()
    shard_group_size: int = 0  # k: the ranks each tensor is sharded over (0: world_size, for plans made by hand)
    shard_ranks: tuple[int, ...] = ()  # this rank's shard group, global ranks in order
    # the shard group: "own" (the setup's), "dedicated" (a second group over its ranks), "partition" (made by the
    # pass over runs of k consecutive ranks: shard_group_size; see thunder_fp8shard.distributed.shard_groups)
    shard_group_origin: str = "own"
    # the run-time operator calls the rewritten traces make a step in the steady state, by operator name (counted in
    # the traces), and those of the first-call checks (thunder_fp8shard.runtime.audit), made only until they are done and then
    # removed from the program (thunder_fp8shard.runtime.steady_state)
    operator_calls: Mapping[str, int] = field(default_factory=dict)
    check_calls: Mapping[str, int] = field(default_factory=dict)
    # the storages saved views could be compacted out of, taken or not (see thunder_fp8shard.analysis.compaction)
    compactions: tuple[Compaction, ...] = ()
    budget_bytes: int | None = None  # policy "budget": the budget every rank planned for (the smallest over the ranks)
    budget_target_bytes: int | None = None  # policy "budget": the predicted peak planned to (the budget less its margin)
    budget_traffic: BudgetTraffic | None = None  # policy "budget": the bytes the choice moves, and the least possible
    # a compilation with no candidate: the saved tensors' bytes by dtype and what would make them candidates
    no_candidates: str = ""
    # fp8_forward_gather: one row per TE linear weight all-gathered in the forward (empty: option off or no such weight)
    forward_gather: tuple[ForwardGather, ...] = ()
    # fp8_forward_gather: Thunder's run-time calls a forward for the weights gathered in FP8 (all-gather, wait, unpad
    # slice, TE linear) and the calls that replace them (the pass's batched starts and fused TE linears, also counted
    # in operator_calls)
    forward_gather_calls: tuple[int, int] = (0, 0)

    def __post_init__(self):
        # the sequences a caller gives as lists are kept as tuples: nothing can append to a plan
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list):
                object.__setattr__(self, f.name, tuple(value))

    @property
    def forward_gather_bytes(self) -> tuple[int, int]:
        """Bytes each rank receives in the forward all-gathers of TE linear weights, one execution, (without, with)
        ``fp8_forward_gather``'s decisions."""
        return (sum(g.received_bytes_before for g in self.forward_gather),
                sum(g.received_bytes_after for g in self.forward_gather))

    @property
    def forward_cast_elements(self) -> tuple[int, int]:
        """Weight elements each rank casts to FP8 in the forward, one execution, (without, with)."""
        return (sum(g.cast_elements_before for g in self.forward_gather),
                sum(g.cast_elements_after for g in self.forward_gather))

    @property
    def k(self) -> int:
        """The ranks each tensor is sharded over: the shard group's size."""
        return self.shard_group_size or self.world_size

    @property
    def saving_fraction(self) -> float:
        """(k-1)/k: the part of each sharded copy's bytes that a rank no longer keeps (before padding)."""
        return (self.k - 1) / self.k

    @property
    def gathered_bytes_per_step(self) -> int:
        """Bytes each rank receives in this program's backward all-gathers, one execution: (k-1) shards a bucket,
        i.e. (k-1)/k of each gathered buffer, padding included (in a ring each rank also sends as many). Under
        ThunderFX a step runs one program per subgraph: sum the plans of the step. ``method="reduce_scatter"``
        moves as many again in the forward."""
        return sum((self.k - 1) * b.shard_nbytes for b in self.buckets)

    @property
    def shard_op_nbytes(self) -> dict[int, int]:
        """Bytes of each shard op's output (its buckets' shards, packed), by op index."""
        return shard_op_nbytes(self.buckets)

    @property
    def gather_steps(self) -> tuple[int, ...]:
        """Timeline steps where the backward all-gathers are issued."""
        return tuple(sorted(b.gather_at for b in self.buckets))

    @property
    def left_out(self) -> list[MemoryTerm]:
        """The terms of unknown size, which the predicted peak leaves out (its headline names them)."""
        return [t for t in self.terms if t.source == UNKNOWN]

    @property
    def sharded(self) -> list[Decision]:
        return [d for d in self.decisions if d.sharded]

    @property
    def compacted(self) -> list[Compaction]:
        return [c for c in self.compactions if c.compacted]

    @property
    def compacted_bytes_per_step(self) -> int:
        """Bytes the compactions copy a step (the compact copies made in forward)."""
        return sum(c.copied_bytes for c in self.compacted)

    def decision(self, name: str) -> Decision:
        for d in self.decisions:
            if d.name == name:
                return d
        raise KeyError(f"no candidate named {name!r} in this plan")


def shard_op_nbytes(buckets) -> dict[int, int]:
    """Bytes of each shard op's output (its buckets' shards, packed), by op index."""
    out: dict[int, int] = {}
    for b in buckets:
        out[b.shard_op] = max(out.get(b.shard_op, 0), b.shard_offset + b.shard_nbytes)
    return out
