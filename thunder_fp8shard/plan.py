"""The plan: immutable data saying, for every candidate, whether it is sharded, why, and what that is predicted to
save; one flat record. :func:`~thunder_fp8shard.pipeline.compile_plan` makes it;
run-time observations go to a separate :class:`~thunder_fp8shard.runtime.run_report.RunReport`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace


@dataclass(frozen=True)
class Step:
    """One position on the joint timeline."""

    index: int  # forward bound symbols, then backward ones
    phase: str  # "forward" or "backward"
    label: str


@dataclass(frozen=True)
class Timeline:
    """Bytes live at each step: after the step's outputs are allocated, before anything is freed."""

    steps: tuple[Step, ...]
    live_bytes: tuple[int, ...]
    backward_start: int  # len(steps) when there is no backward

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
    kind: str  # "float8", "te_float8" or "tensor"
    nbytes: int  # real payload bytes (1 per element for TE FP8 tensors, whatever the proxy prints)
    replicated: bool
    sharded: bool
    reason: str
    shard_nbytes: int = 0
    storage_nbytes: int = 0  # what sharding frees (a view can be larger or smaller); 0: take ``nbytes``
    # a forward input that already is this rank's shard (a Thunder FSDP parameter shard): nothing is copied or kept
    shard_source: str = ""

    @property
    def bytes_saved(self) -> int:
        """The storage's bytes freed less the shard kept (none where the shard is an input)."""
        if not self.sharded:
            return 0
        return (self.storage_nbytes or self.nbytes) - (0 if self.shard_source else self.shard_nbytes)


@dataclass(frozen=True)
class Compaction:
    """A storage kept alive to backward only by saved views smaller than it (e.g. LitGPT's ``v`` of ``qkv``): each
    view can be replaced by a compact copy after the storage's last forward use, freeing the rest. Rank-local and
    bitwise exact. Steps are those of the unmodified joint program; bytes are per rank."""

    storage: str  # the storage's base tensor
    members: tuple[str, ...]  # its saved views
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    member_nbytes: tuple[int, ...]
    storage_nbytes: int
    compact_at: int  # the copies are made after this step: the last forward use, or where the planner moved them
    ends: tuple[int, ...]  # the last step each copy is held to
    compacted: bool = False
    reason: str = ""
    shard_op: int | None = None  # the shard op that makes the copies (None: an fp8shard_compact call)
    moved_from: int | None = None

    @property
    def copied_bytes(self) -> int:
        return sum(self.member_nbytes)

    @property
    def freed_bytes(self) -> int:
        return self.storage_nbytes - self.copied_bytes


MEASURED = "measured"  # read from the device during the first compilation
MODELLED = "modelled"
GIVEN = "given"
NOT_COUNTED = "not counted"  # exists but 0 here
UNKNOWN = "unknown"  # of unknown size: left out of the predicted peak, and the headline says so
AGREED = "agreed"  # another rank's larger value


@dataclass(frozen=True)
class MemoryTerm:
    """Device memory of the step besides the program's own tensors, as ``spans`` ``(first step, last step, bytes)``,
    inclusive. Per rank."""

    name: str
    source: str  # one of the constants above
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
    """A plan input that can differ between ranks, as every rank planned with it: a memory term's bytes (the
    largest) or ``budget_bytes`` (the smallest)."""

    name: str
    value: int
    own: int
    rule: str  # "largest" or "smallest"


@dataclass(frozen=True)
class Bucket:
    """Sharded tensors kept as one shard and all-gathered back as one buffer. Steps are those of the unmodified
    joint program; bytes are per rank."""

    index: int
    members: tuple[str, ...]  # in order of first backward use
    nbytes: int
    shard_nbytes: int  # alignment included
    gathered_nbytes: int
    shard_at: int  # the last forward use of any member
    gather_at: int
    first_use: int  # the first backward use of any member; the wait is right before
    shard_op: int = 0  # the forward shard op holding this bucket's shard (one op can serve several)
    shard_offset: int = 0  # bytes into that op's output
    shard_until: int | None = None  # the wait of that op's last bucket
    # the forward inputs that are this rank's shards of its members: no shard op and no bytes kept, one coalesced
    # all-gather of them. Empty: a shard op's bucket
    sources: tuple[str, ...] = ()
    # the first bucket of a shard op after the first: why the previous op did not take it (grouping.STOPS; "": not
    # decided here, e.g. the model's agreed layout)
    merge_stop: str = ""


@dataclass(frozen=True)
class ForwardGather:
    """One TE linear weight's forward all-gather under ``fp8_forward_gather``: gathered in FP8 or left in bf16, and
    why. Bytes are per rank and execution."""

    weight: str  # this rank's parameter shard
    shape: tuple[int, ...]  # the full unpadded weight
    fp8: bool
    reason: str
    received_bytes_before: int
    received_bytes_after: int
    cast_elements_before: int
    cast_elements_after: int


@dataclass(frozen=True)
class BudgetTraffic:
    """Policy "budget": the bytes the choice moves a step, and a lower bound for any choice meeting the target
    (None: none meets it)."""

    moved_bytes: int
    lower_bound_bytes: int | None


@dataclass(frozen=True)
class ShardPlan:
    """What the pass decided for one compiled cache entry (forward + backward trace). Bytes are per rank. Lists given
    become tuples: nothing can append to a plan."""

    # the setup and the options it was made under
    world_size: int  # under FSDP2 HSDP, of the whole mesh
    method: str
    policy: str
    prefetch: int
    bucket_bytes: int = 0
    comm: str = ""  # "shared" or "dedicated"
    integration: str = ""
    shard_group_size: int = 0  # k; 0: world_size (plans made by hand)
    shard_ranks: tuple[int, ...] = ()  # global ranks in order
    shard_group_origin: str = "own"  # "own", "dedicated" or "partition"
    # sharding (own shards included: ``Decision.shard_source``, ``Bucket.sources``)
    decisions: tuple[Decision, ...] = ()
    buckets: tuple[Bucket, ...] = ()
    no_candidates: str = ""  # with no candidate: the saved bytes by dtype and what would make them candidates
    compactions: tuple[Compaction, ...] = ()  # taken or not
    forward_gather: tuple[ForwardGather, ...] = ()
    # Thunder's forward calls for the weights gathered in FP8, and the pass's calls that replace them
    forward_gather_calls: tuple[int, int] = (0, 0)
    rescheduled: bool = False  # Thunder FSDP's collectives moved (its "before" stays Thunder's order)
    # the memory model's verdict, before and after the pass
    saved_bytes_before: int = 0  # each storage once, as saved_tensors_hooks sees them
    saved_bytes_after: int = 0
    peak_bytes_before: int | None = None  # predicted device peak: the joint program plus ``terms``
    peak_bytes_after: int | None = None
    program_peak_bytes_before: int | None = None  # the program's own tensors only
    program_peak_bytes_after: int | None = None
    terms: tuple[MemoryTerm, ...] = ()
    timeline_before: Timeline | None = None
    timeline_after: Timeline | None = None
    budget_bytes: int | None = None  # the smallest over the ranks
    budget_target_bytes: int | None = None  # the budget less its margin
    budget_traffic: BudgetTraffic | None = None
    # the run-time operator calls a steady-state step makes, and those of the first-call checks
    operator_calls: Mapping[str, int] = field(default_factory=dict)
    check_calls: Mapping[str, int] = field(default_factory=dict)
    agreed: tuple[AgreedValue, ...] = ()
    notes: tuple[str, ...] = ()
    pass_seconds: float = 0.0

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list):
                object.__setattr__(self, f.name, tuple(value))

    @classmethod
    def of(cls, world_size: int, method: str, policy: str, prefetch: int, decisions=(), saved_bytes_before: int = 0,
           saved_bytes_after: int = 0, **changes) -> ShardPlan:
        """A plan from its setup's first four fields, its decisions and saved bytes (plans made by hand)."""
        return cls(world_size, method, policy, prefetch, decisions=decisions, saved_bytes_before=saved_bytes_before,
                   saved_bytes_after=saved_bytes_after, **changes)

    def replaced(self, **changes) -> ShardPlan:
        return replace(self, **changes)

    @property
    def forward_gather_bytes(self) -> tuple[int, int]:
        """Bytes each rank receives in the forward weight all-gathers, (without, with) ``fp8_forward_gather``."""
        return (sum(g.received_bytes_before for g in self.forward_gather),
                sum(g.received_bytes_after for g in self.forward_gather))

    @property
    def forward_cast_elements(self) -> tuple[int, int]:
        """Weight elements each rank casts to FP8 in the forward, (without, with)."""
        return (sum(g.cast_elements_before for g in self.forward_gather),
                sum(g.cast_elements_after for g in self.forward_gather))

    @property
    def k(self) -> int:
        """The ranks each tensor is sharded over."""
        return self.shard_group_size or self.world_size

    @property
    def gathered_bytes_per_step(self) -> int:
        """Bytes each rank receives in this program's backward all-gathers, padding included. Under ThunderFX, sum
        the plans of the step's subgraphs."""
        return sum((self.k - 1) * b.shard_nbytes for b in self.buckets)

    @property
    def shard_op_nbytes(self) -> dict[int, int]:
        return shard_op_nbytes(self.buckets)

    @property
    def gather_steps(self) -> tuple[int, ...]:
        return tuple(sorted(b.gather_at for b in self.buckets))

    @property
    def left_out(self) -> list[MemoryTerm]:
        """The terms of unknown size, which the predicted peak leaves out."""
        return [t for t in self.terms if t.source == UNKNOWN]

    @property
    def sharded(self) -> list[Decision]:
        return [d for d in self.decisions if d.sharded]

    @property
    def compacted(self) -> list[Compaction]:
        return [c for c in self.compactions if c.compacted]

    @property
    def compacted_bytes_per_step(self) -> int:
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
