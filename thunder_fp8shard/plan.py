"""The plan: plain data saying, for every candidate, whether it is sharded and why, and what that is predicted to save.

``str(plan)`` renders a table; ``plan.plot()`` draws the predicted memory timelines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from thunder_fp8shard.reporting.format import fmt_bytes, table

if TYPE_CHECKING:  # pragma: no cover
    from thunder_fp8shard.analysis.liveness import Timeline


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

    @property
    def bytes_saved(self) -> int:
        """The storage's bytes freed less the shard kept: what sharding saves this rank."""
        return (self.storage_nbytes or self.nbytes) - self.shard_nbytes if self.sharded else 0


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


@dataclass
class ShardPlan:
    """What the pass did to one compiled cache entry (forward trace + backward trace)."""

    world_size: int  # ranks of the setup's group (under FSDP2 HSDP, of the whole mesh)
    method: str
    policy: str
    prefetch: int
    decisions: list[Decision]
    saved_bytes_before: int  # per rank, each storage once, as saved_tensors_hooks sees them
    saved_bytes_after: int
    peak_bytes_before: int | None = None  # predicted per-rank device peak: the joint program plus ``terms``
    peak_bytes_after: int | None = None
    program_peak_bytes_before: int | None = None  # the joint forward+backward program's own tensors only
    program_peak_bytes_after: int | None = None
    terms: list[MemoryTerm] = field(default_factory=list)  # memory of the step outside the program, per source
    timeline_before: Timeline | None = None
    timeline_after: Timeline | None = None
    buckets: list[Bucket] = field(default_factory=list)
    bucket_bytes: int = 0
    comm: str = ""  # the process group the shards travel on: "shared" (the setup's own) or "dedicated"
    integration: str = ""  # the distributed setup the pass recognized, e.g. "Thunder FSDP (ZeRO-3)"
    pass_seconds: float = 0.0  # wall time of both hooks of the pass (analysis, plan, rewrite) for this entry
    agreed: list[AgreedValue] = field(default_factory=list)  # the per-rank inputs agreed across the ranks
    notes: list[str] = field(default_factory=list)
    shard_group_size: int = 0  # k: the ranks each tensor is sharded over (0: world_size, for plans made by hand)
    shard_ranks: tuple[int, ...] = ()  # this rank's shard group, global ranks in order
    # the shard group: "own" (the setup's), "dedicated" (a second group over its ranks), "partition" (made by the
    # pass over runs of k consecutive ranks: shard_group_size; see thunder_fp8shard.distributed.shard_groups)
    shard_group_origin: str = "own"
    # the run-time operator calls the rewritten traces make a step in the steady state, by operator name (counted in
    # the traces), and those of the first-call checks (thunder_fp8shard.runtime.audit), made only until they are done and then
    # removed from the program (thunder_fp8shard.runtime.steady_state)
    operator_calls: dict[str, int] = field(default_factory=dict)
    check_calls: dict[str, int] = field(default_factory=dict)
    # the storages saved views could be compacted out of, taken or not (see thunder_fp8shard.analysis.compaction)
    compactions: list[Compaction] = field(default_factory=list)
    budget_bytes: int | None = None  # policy "budget": the budget every rank planned for (the smallest over the ranks)
    budget_target_bytes: int | None = None  # policy "budget": the predicted peak planned to (the budget less its margin)
    # policy "budget": the bytes the choice moves a step and a lower bound on what any choice meeting the target must
    # move ({"moved_bytes", "lower_bound_bytes"}, see thunder_fp8shard.planning.planner.least_traffic)
    budget_traffic: dict | None = None
    # filled at run time (thunder_fp8shard.runtime.audit): what the forward saved at the first call against the model, and
    # the device's peak at the calibration step against the prediction
    audit: dict | None = None
    calibration: dict | None = None
    # filled at run time: when and how the first-call checks were removed from the program (None: not yet)
    checks_removed: str | None = None
    # the forward calls of this compiled program in the first step, counted at run time (until its first backward):
    # under ThunderFX one program serves every block of the same class and shapes; None until the first backward
    runs_per_step: int | None = None
    # a compilation with no candidate: the saved tensors' bytes by dtype and what would make them candidates
    no_candidates: str = ""
    # fp8_forward_gather: one row per TE linear weight all-gathered in the forward (empty: option off or no such weight)
    forward_gather: list[ForwardGather] = field(default_factory=list)
    # fp8_forward_gather: Thunder's run-time calls a forward for the weights gathered in FP8 (all-gather, wait, unpad
    # slice, TE linear) and the calls that replace them (the pass's batched starts and fused TE linears, also counted
    # in operator_calls)
    forward_gather_calls: tuple[int, int] = (0, 0)

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

    def __str__(self) -> str:
        header = ("tensor", "shape", "dtype", "kind", "bytes", "replicated", "sharded", "reason")
        rows = [
            (d.name, "x".join(map(str, d.shape)) or "()", d.dtype, d.kind, f"{d.nbytes:,}",
             "yes" if d.replicated else "no", f"1/{self.k}" if d.sharded else "no", d.reason)
            for d in self.decisions
        ]
        if self.shard_group_origin == "none":  # CompactSavedViews: no distributed setup
            lines = [f"CompactSavedViews plan: no distributed setup, nothing sharded, policy {self.policy}; the pass "
                     f"took {self.pass_seconds:.2f} s"]
        else:
            lines = [
                f"ShardIntermediates plan: {self.integration or 'no distributed setup'}, world size {self.world_size}, "
                f"{self._shard_group_words()}, method {self.method}, policy {self.policy}, "
                f"prefetch {self.prefetch}; {len(self.sharded)} of {len(self.decisions)} candidates sharded, "
                + (f"in {len(self.buckets)} bucket(s) kept by {len({b.shard_op for b in self.buckets})} shard op(s), "
                   f"each of at most {fmt_bytes(self.bucket_bytes)}" if self.bucket_bytes else "one tensor a bucket")
                + f", on {self._group_words()}; the pass took {self.pass_seconds:.2f} s",
                *table(header, rows),
            ]
        lines[1:1] = [self.verdict, *([self.no_candidates] if self.no_candidates else [])]
        lines += [
            *self._compaction_table(),
            f"saved for backward per rank: {fmt_bytes(self.saved_bytes_before)} -> {fmt_bytes(self.saved_bytes_after)}",
            f"all-gathered per rank per step (received in backward, (k-1)/k of the gathered buffers): "
            f"{fmt_bytes(self.gathered_bytes_per_step)}" + (" (and as much reduce-scattered in forward)"
                                                            if self.method == "reduce_scatter" and self.buckets else ""),
        ]
        if self.operator_calls:
            calls = self.operator_calls
            lines.append(f"run-time operator calls per step: {sum(calls.values())} ("
                         + ", ".join(f"{n} {name}" for name, n in calls.items() if n) + ")"
                         + (f"; the first steps also call the first-call checks ("
                            + ", ".join(f"{n} {name}" for name, n in self.check_calls.items() if n)
                            + "), removed from the program once done (at the end of the calibration step)"
                            if any(self.check_calls.values()) else ""))
        if self.peak_bytes_before is not None and self.peak_bytes_after is not None:
            lines += self._terms_table()
            lines += self._agreed_table()
            lines.append(
                f"predicted peak per rank:     {fmt_bytes(self.peak_bytes_before)} -> {fmt_bytes(self.peak_bytes_after)}"
                + _peak_where(self.timeline_before, self.timeline_after)
                + (f", WITHOUT {len(self.left_out)} term(s) of unknown size:" if self.left_out else "")
            )
            lines += [f"  leaves out the {t.name}: {t.how}" for t in self.left_out]
        if self.budget_traffic:
            t = self.budget_traffic
            bound = t["lower_bound_bytes"]
            lines.append(f"budget: the choice moves {fmt_bytes(t['moved_bytes'])} a step (shards' payloads, compactions' "
                         "copies); " + ("no choice meeting the target can move less than "
                                        f"{fmt_bytes(bound)}" if bound is not None else "no choice can meet the target"))
        lines += self._forward_gather_lines()
        lines += self._run_time_lines()
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    @property
    def verdict(self) -> str:
        """One line: the predicted peak and the bytes saved for backward, before -> after, and whether they fell."""
        saved = f"saved for backward {_change(self.saved_bytes_before, self.saved_bytes_after)}"
        if not self.sharded and not self.compacted:
            peak = (f"predicted peak {fmt_bytes(self.peak_bytes_before)} and " if self.peak_bytes_before is not None
                    else "")
            return f"verdict: nothing sharded or compacted: {peak}saved for backward " \
                   f"{fmt_bytes(self.saved_bytes_before)} unchanged"
        if self.peak_bytes_before is None or self.peak_bytes_after is None:
            return f"verdict: {saved}"
        return f"verdict: predicted peak {_change(self.peak_bytes_before, self.peak_bytes_after)}; {saved}"

    @property
    def peak_words(self) -> str:
        """The predicted peak's change in words, e.g. "falls by 1.2 MiB", "unchanged", "RISES by 8.0 KiB"."""
        if self.peak_bytes_before is None or self.peak_bytes_after is None:
            return "not predicted"
        return _direction(self.peak_bytes_before, self.peak_bytes_after)

    def _compaction_table(self) -> list[str]:
        """The compaction options: each storage, its saved views, what a compact copy frees and copies, and why."""
        if not self.compactions:
            return []
        header = ("storage", "saved views", "storage bytes", "freed", "copied a step", "compacted", "reason")
        rows = [(c.storage, ", ".join(f"{m} {'x'.join(map(str, sh))} {dt}" for m, sh, dt in zip(c.members, c.shapes,
                                                                                               c.dtypes)),
                 f"{c.storage_nbytes:,}", f"{c.freed_bytes:,}", f"{c.copied_bytes:,}", "yes" if c.compacted else "no",
                 c.reason) for c in self.compactions]
        taken = self.compacted
        head = (f"compaction of saved views: {len(taken)} of {len(self.compactions)} storages compacted, "
                f"{fmt_bytes(sum(c.freed_bytes for c in taken))} freed, {fmt_bytes(self.compacted_bytes_per_step)} "
                "copied a step")
        return [head, *table(header, rows)]

    def _forward_gather_lines(self) -> list[str]:
        """fp8_forward_gather: each TE linear weight's forward all-gather, FP8 or bf16 and why, and the totals."""
        if not self.forward_gather:
            return []
        (rb, ra), (cb, ca) = self.forward_gather_bytes, self.forward_cast_elements
        head = (f"forward all-gather of TE linear weights (fp8_forward_gather): "
                f"{sum(g.fp8 for g in self.forward_gather)} of {len(self.forward_gather)} in FP8; received per rank "
                f"{fmt_bytes(rb)} -> {fmt_bytes(ra)}, weight elements cast per rank {cb:,} -> {ca:,}"
                + (f"; run-time calls for them {self.forward_gather_calls[0]} -> {self.forward_gather_calls[1]}"
                   if any(self.forward_gather_calls) else ""))
        rows = [(g.weight, "x".join(map(str, g.shape)), "fp8" if g.fp8 else "bf16", f"{g.received_bytes_after:,}",
                 g.reason) for g in self.forward_gather]
        return [head, *table(("weight", "shape", "gathered as", "received bytes", "reason"), rows)]

    def _run_time_lines(self) -> list[str]:
        """What the run-time checks found (see thunder_fp8shard.runtime.audit), once they ran."""
        out = []
        if self.audit is not None:
            a = self.audit
            out.append(f"saved at the first call (measured): {fmt_bytes(a['measured_saved_bytes'])}, modelled "
                       f"{fmt_bytes(a['predicted_saved_bytes'])}" + (
                           f"; {len(a['differences'])} storage(s) differ (the term 'saved storages at the first call')"
                           if a["differences"] else ""))
        if self.calibration is not None:
            c = self.calibration
            out.append(f"calibration ({c['at']}): device peak {fmt_bytes(c['measured_peak_bytes'])}, predicted "
                       f"{fmt_bytes(c['predicted_peak_bytes'])}, error {c['error_bytes']:+,} B "
                       f"({c['error_pct']:+.2f}%)" + (", over the budget: replanned at the next call"
                                                       if c.get("budget_missed") else ""))
        if self.checks_removed is not None:
            out.append(f"first-call checks: {self.checks_removed}")
        if self.runs_per_step and self.runs_per_step > 1:
            out.append(f"this program ran {self.runs_per_step} times in the first step (one subgraph serving "
                       f"{self.runs_per_step} blocks): its bytes count {self.runs_per_step} times a step")
        return out

    def _shard_group_words(self) -> str:
        k, n = self.k, self.world_size
        ranks = f" (this rank: {_fmt_ranks(self.shard_ranks)})" if self.shard_ranks else ""
        which = "the whole group" if k == n else f"subgroups of k={k} ranks"
        return f"shards over {which}{ranks}: each copy keeps 1/{k}, saving {k - 1}/{k} of it"

    def _group_words(self) -> str:
        return {"own": "the setup's process group", "dedicated": "a dedicated process group over the setup's ranks",
                "partition": f"process groups the pass made over runs of {self.k} consecutive ranks"}[self.shard_group_origin]

    def _terms_table(self) -> list[str]:
        """The memory model's terms: the program's own peak, then each term outside it with its source."""
        if self.program_peak_bytes_before is None:
            return []
        n = len(self.timeline_before.steps) if self.timeline_before is not None else 0
        rows = [("jitted program (its peak)", f"{self.program_peak_bytes_before:,} -> {self.program_peak_bytes_after:,}",
                 "", MODELLED, "liveness of the joint forward+backward program")]
        rows += [(t.name, f"{t.nbytes:,}", t.where(n), t.source, t.how) for t in self.terms]
        header = ("memory model (device bytes per rank)", "bytes", "steps", "source", "how")
        return table(header, rows)

    def _agreed_table(self) -> list[str]:
        """The inputs agreed across the ranks before planning: the value planned with against this rank's own."""
        if not self.agreed:
            return []
        rows = [(a.name, a.rule, f"{a.value:,}", f"{a.own:,}", "" if a.value == a.own else "another rank's")
                for a in self.agreed]
        # over the shard group: the ranks the plan's collectives span
        header = (f"agreed over {self.k} ranks before planning", "rule", "planned with", "this rank's own", "")
        return table(header, rows)

    def plot(self, path=None):
        """The predicted memory timeline before and after, with peaks and gathers marked (a matplotlib Figure)."""
        from thunder_fp8shard.reporting.plot import plot_timelines

        if self.timeline_before is None:
            raise ValueError("this plan has no memory timeline (forward-only compile or nothing to model)")
        return plot_timelines(
            self.timeline_before, self.timeline_after, gathers=self.gather_steps,
            title=f"ShardIntermediates: {len(self.sharded)} tensors sharded 1/{self.k}, {len(self.compacted)} storages "
                  f"compacted; predicted peak {self.peak_words}", path=path,
        )


def shard_op_nbytes(buckets) -> dict[int, int]:
    """Bytes of each shard op's output (its buckets' shards, packed), by op index."""
    out: dict[int, int] = {}
    for b in buckets:
        out[b.shard_op] = max(out.get(b.shard_op, 0), b.shard_offset + b.shard_nbytes)
    return out


def _direction(before: int, after: int) -> str:
    if after < before:
        return f"falls by {fmt_bytes(before - after)}"
    if after > before:
        return f"RISES by {fmt_bytes(after - before)}"
    return "unchanged"


def _change(before: int, after: int) -> str:
    return f"{fmt_bytes(before)} -> {fmt_bytes(after)} ({_direction(before, after)})"


def _peak_where(before, after) -> str:
    if before is None or after is None:
        return ""
    return f" (before at {before.peak_step.phase} step {before.peak_step.index}, after at {after.peak_step.phase} step {after.peak_step.index})"


def _fmt_ranks(ranks: tuple[int, ...]) -> str:
    if len(ranks) > 2 and list(ranks) == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return f"ranks {', '.join(map(str, ranks))}"
