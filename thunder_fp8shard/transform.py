"""``ShardIntermediates``: the Thunder transform tying analysis, plan and rewrite together.

Thunder calls the post-optimization hook on the forward trace, then on the backward trace, of each compiled cache
entry. What to shard is decided on the joint program, so the forward hook returns a stand-in trace and the
backward hook plans, rewrites both traces, and fills the stand-in in place (Thunder builds the forward callable
from it only after both hooks ran). Hence ShardIntermediates must be the last transform with a post-optimization
hook; this is checked. Before planning, the inputs that can differ between ranks are agreed across the shard group
(the ranks that run the plan's collectives together), and the plan's collectives are compared across it before the
rewrite (see :mod:`thunder_fp8shard.agreement`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import warnings
from collections.abc import Callable
from typing import TypeVar

from thunder.core.compile_data import _compile_data, get_compile_data
from thunder.core.proxies import TensorProxy
from thunder.core.trace import TraceCtx, TraceProvenance, TraceTag, from_trace
from thunder.core.transform_common import Transform

from thunder_fp8shard import integrations
from thunder_fp8shard.agreement import agree, check, largest
from thunder_fp8shard.audit import Calibration, SavedAudit, cache_dropper, calibration_term, expected_storages
from thunder_fp8shard.candidates import find_candidates, te_quantized_names
from thunder_fp8shard.device_memory import DeviceMemory, has_cublas_gemms, measure, program_device
from thunder_fp8shard.grouping import shard_op_nbytes
from thunder_fp8shard.liveness import storage_of
from thunder_fp8shard.memory_model import MemoryModel, memory_model
from thunder_fp8shard.options import ShardOptions
from thunder_fp8shard.plan import ShardPlan
from thunder_fp8shard.planner import budget_target, choose, soundness
from thunder_fp8shard.replication import analyze_replication
from thunder_fp8shard.rewrite import (
    BucketRequest, CompactionRequest, ShardOpRequest, operator_calls, rewrite_backward, rewrite_forward,
    with_run_checks,
)
from thunder_fp8shard.saved import backward_saved, forward_saved, model_io_names, numel, tensor_nbytes
from thunder_fp8shard.shard_groups import ShardGroup, ShardGroups

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., None])


@dataclasses.dataclass
class _PendingForward:
    """The forward of the cache entry being compiled, waiting for its backward."""

    original: TraceCtx
    stand_in: TraceCtx  # what Thunder holds; filled with the rewritten forward by the backward hook
    seconds: float  # time the forward hook took
    device: DeviceMemory | None  # what the device's allocator said while this entry compiled (None on the CPU)
    setup: integrations.Integration | None  # the distributed setup recognized for this compilation (None: compaction
    # alone, CompactSavedViews)
    shards: ShardGroup | None  # where this rank's shards live and travel
    stats: object = None  # Thunder's compile stats of the function being compiled (its cache)


def _unknown_options_named(init: F) -> F:
    """``init`` raising a TypeError that names every unknown option and lists the options (Python's own names one
    unknown keyword). ``inspect.signature`` and ``help()`` show ``init``'s own signature (through ``__wrapped__``)."""
    known = [f.name for f in dataclasses.fields(ShardOptions)]

    @functools.wraps(init)
    def checked(self, *args, **options):
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise TypeError(f"ShardIntermediates: unknown option(s) {unknown}; the options are {known}")
        return init(self, *args, **options)

    return checked  # type: ignore[return-value]


class ShardIntermediates(Transform):
    """Shards saved-for-backward tensors that are identical on every rank (Thunder FSDP or DDP, PyTorch FSDP2 under
    ThunderFX, see :mod:`thunder_fp8shard.integrations`) and all-gathers them back just before their backward
    consumers. Gradients are bitwise identical to the run without the pass.

    Use as the last transform: ``thunder.jit(model, transforms=[FSDPTransform(sharding_strategy=FSDPType.ZERO3),
    ShardIntermediates()])``, or inside ``thunder.distributed.fsdp(...)`` / ``ddp(...)``, or in ThunderFX's
    transforms over an FSDP2 model: ``torch.compile(model, backend=ThunderCompiler(transforms=[ShardIntermediates()]))``.
    Each rank keeps a 1/k shard over its shard group (:mod:`thunder_fp8shard.shard_groups`): the setup's group, or with
    ``shard_group_size=k`` its run of k consecutive ranks; which tensors are identical is decided over the setup's
    whole group. ``plans`` holds one :class:`~thunder_fp8shard.plan.ShardPlan` per compiled cache entry (under
    ThunderFX, of each subgraph), newest last.

    Options, keyword-only, validated at construction by :class:`~thunder_fp8shard.options.ShardOptions` (its
    docstring and the README's "Options" table say more):

    - ``candidates``: ``"fp8"`` (float8 and TransformerEngine's quantized saved tensors) or ``"all"`` saved tensors.
    - ``min_bytes``: smaller candidates are left alone.
    - ``compact``: ``"auto"`` replaces saved views that keep a larger storage alive by compact copies (where that
      frees more than it copies); ``"off"``.
    - ``method``: ``"slice"`` (keep this rank's slice, no communication) or ``"reduce_scatter"`` (MAX over the ranks).
    - ``verify``: at shard time, check with digests that every rank holds the same bytes.
    - ``policy``: ``"all"`` sound candidates; ``"peak"``: those that lower the predicted peak; ``"budget"``: the
      least all-gather traffic that brings it to ``budget_bytes``.
    - ``budget_bytes``: the per-rank device peak for ``policy="budget"`` (``max_memory_allocated``'s figure).
    - ``prefetch``: how many buckets ahead of its first use each backward all-gather is issued.
    - ``bucket_bytes``: the most payload bytes one all-gather (a bucket) or one forward shard op handles (0: one
      tensor each).
    - ``comm``: ``"shared"``: the shards travel on the setup's process group; ``"dedicated"``: on a second group over
      its ranks.
    - ``resident_bytes``: device bytes alive during the step besides the program (None: measured while compiling).
    - ``optimizer_states``: the optimizer's state tensors per trained parameter (AdamW: 2; None: unknown, left out of
      the predicted peak; ``policy="budget"`` needs it).
    - ``loss_bytes``: bytes the loss holds at the start of the backward (None: 2 x the forward's outputs).
    - ``group``: a process group, for compilations whose setup names none.
    - ``shard_group_size``: shard over subgroups of this many consecutive ranks (None: the setup's group).
    """

    @_unknown_options_named
    def __init__(
        self,
        *,
        candidates: str = "fp8",
        min_bytes: int = 1024,
        compact: str = "auto",
        method: str = "slice",
        verify: bool = False,
        policy: str = "all",
        budget_bytes: int | None = None,
        prefetch: int = 1,
        bucket_bytes: int = 1 << 30,
        comm: str = "shared",
        resident_bytes: int | None = None,
        optimizer_states: int | None = None,
        loss_bytes: int | None = None,
        group: object = None,
        shard_group_size: int | None = None,
    ):
        # the parameters are ShardOptions' fields, with its defaults (tests/test_bad_input.py checks it)
        self.options = ShardOptions(
            candidates=candidates, min_bytes=min_bytes, compact=compact, method=method, verify=verify, policy=policy,
            budget_bytes=budget_bytes, prefetch=prefetch, bucket_bytes=bucket_bytes, comm=comm,
            resident_bytes=resident_bytes, optimizer_states=optimizer_states, loss_bytes=loss_bytes, group=group,
            shard_group_size=shard_group_size,
        )
        self.plans: list[ShardPlan] = []
        self._pending: _PendingForward | None = None
        self._groups = ShardGroups(self.options.comm, self.options.shard_group_size)  # created once, then reused
        self._calibration_bytes: int | None = None  # set by a missed budget: planned with from then on

    def transform_trace_post_optimization(self, computation_trace: TraceCtx, **kwargs) -> TraceCtx:
        if TraceTag.AUGMENTED_FORWARD in computation_trace.tags:
            return self._forward(computation_trace)
        if TraceTag.BACKWARD in computation_trace.tags:
            return self._backward(computation_trace)
        return computation_trace

    def _setup(self) -> tuple[integrations.Integration | None, ShardGroup | None]:
        """The distributed setup of this compilation and this rank's shard group."""
        setup = integrations.detect(get_compile_data(), self.options)
        # on every compilation, whatever it saves: creating groups is collective, every rank must do it alike
        return setup, self._groups.for_setup(setup.group, setup.ranks, setup.name)

    def _forward(self, fw: TraceCtx) -> TraceCtx:
        start = time.perf_counter()
        self._pending = None
        _check_last_post_optimization_transform(self)
        setup, shards = self._setup()
        if not forward_saved(fw)[0]:
            plan = self._empty_plan(setup, shards)
            plan.notes.append("forward-only compile (no_grad or no input requires grad): nothing is saved for backward")
            self._record(plan)
            return fw
        stand_in = from_trace(fw)
        stand_in.bound_symbols = list(fw.bound_symbols)
        stand_in.set_provenance(TraceProvenance(f"{type(self).__name__}: forward as compiled, until its backward is planned"))
        device = measure(fw, transformer_engine=bool(te_quantized_names(fw)), cublas=has_cublas_gemms(fw))
        stats = _compile_data.get()[1]
        self._pending = _PendingForward(fw, stand_in, time.perf_counter() - start, device, setup, shards, stats)
        return stand_in

    def _backward(self, bw: TraceCtx) -> TraceCtx:
        start = time.perf_counter()
        pending, self._pending = self._pending, None
        if pending is None:
            return bw
        fw = pending.original
        if len(backward_saved(bw)[0]) != len(forward_saved(fw)[0]):
            raise RuntimeError("ShardIntermediates: the backward trace does not match the forward it follows")
        shards = pending.shards
        group = shards.group if shards is not None else None  # the shards' collectives: the shard group's
        world_size = shards.size if shards is not None else 1
        plan, model, requests = self._plan(fw, bw, pending)
        if group is not None:
            check(plan, group, verify=self.options.verify)  # before any collective of the plan
        o = self.options
        saved_of = {p.name: p for p in forward_saved(fw)[0]}
        compactions = [CompactionRequest(tuple(saved_of[m] for m in c.members), fw.bound_symbols[c.compact_at])
                       for c in plan.compacted]
        n = sum(len(r.members) for op in requests for r in op.buckets)
        n_buckets = sum(len(op.buckets) for op in requests)
        new_fw = rewrite_forward(
            fw, requests, group=group, world_size=world_size, method=o.method, verify=o.verify,
            compactions=compactions,
            provenance=f"{type(self).__name__}: {n} saved tensors kept as 1/{world_size} shards of {n_buckets} "
            f"bucket(s) by {len(requests)} shard op(s) ({o.method}), {len(compactions)} compaction(s)",
        )
        new_bw, _ = rewrite_backward(
            bw, new_fw, group=group, prefetch=o.prefetch,
            provenance=f"{type(self).__name__}: {n_buckets} bucket(s) all-gathered (prefetch {o.prefetch})",
        )
        audit = SavedAudit(plan, expected_storages(model, plan, new_fw), [getattr(p, "name", "") for p in new_fw.saved
                                                                        if isinstance(p, TensorProxy)])
        calibration = Calibration(plan, program_device(fw), plan.budget_bytes, functools.partial(largest, group=group),
                                  functools.partial(self._replan, pending.stats), audit)
        fw_trace, new_bw = with_run_checks(new_fw, new_bw, audit, calibration)
        pending.stand_in.bound_symbols = fw_trace.bound_symbols
        pending.stand_in.set_provenance(fw_trace.get_provenance())
        plan.operator_calls = operator_calls(fw_trace, new_bw)
        plan.pass_seconds = pending.seconds + time.perf_counter() - start
        self._record(plan)
        return new_bw

    def _replan(self, compile_stats, error_bytes: int) -> None:
        """After a missed budget (every rank alike, see :class:`~thunder_fp8shard.audit.Calibration`): plan every later
        compilation with the error as a measured term, and make the next call compile again."""
        self._calibration_bytes = max(self._calibration_bytes or 0, 0) + max(error_bytes, 0)
        cache_dropper(compile_stats)()

    def _empty_plan(self, setup: integrations.Integration | None, shards: ShardGroup | None) -> ShardPlan:
        o = self.options
        if setup is None:  # compaction alone: no distributed setup
            return ShardPlan(1, o.method, o.policy, o.prefetch, [], 0, 0, bucket_bytes=o.bucket_bytes, comm="",
                             integration="", shard_group_size=1, shard_group_kind="none")
        return ShardPlan(setup.world_size, o.method, o.policy, o.prefetch, [], 0, 0, bucket_bytes=o.bucket_bytes,
                         comm=o.comm, integration=setup.name, notes=list(setup.notes), shard_group_size=shards.size,
                         shard_ranks=shards.ranks, shard_group_kind=shards.kind)

    def _plan(self, fw: TraceCtx, bw: TraceCtx, pending: _PendingForward
              ) -> tuple[ShardPlan, MemoryModel, list[ShardOpRequest]]:
        # replicated over the setup's whole group; sharded (and laid out) over this rank's shard group
        o, setup, shards = self.options, pending.setup, pending.shards
        world_size = shards.size if shards is not None else 1
        te_names = te_quantized_names(fw)
        candidates = find_candidates(fw, o.candidates) if setup is not None else []
        nbytes_of = lambda p: numel(p) if p.name in te_names else tensor_nbytes(p)  # noqa: E731
        model = memory_model(fw, bw, candidates, nbytes_of, options=o, device=pending.device)
        if self._calibration_bytes:
            model = dataclasses.replace(model, terms=(*model.terms, calibration_term(self._calibration_bytes,
                                                                                     len(model.steps) - 1)))
        # the same inputs, hence the same plan, on every rank that runs the plan's collectives with this one
        agreed = agree(model.terms, o.budget_bytes, shards.group if shards is not None else None)
        model = dataclasses.replace(model, terms=agreed.terms)
        o = dataclasses.replace(o, budget_bytes=agreed.budget_bytes)
        saved_names = {p.name for p in forward_saved(fw)[0]}
        sound = []
        if setup is not None:
            replication = analyze_replication(fw, setup.group, setup.replicated_inputs(fw), setup.input_reasons(fw))
            sound = soundness(candidates, replication, model_io_names(fw), o, world_size, model, saved_names)
        choice = choose(sound, model, o, world_size)
        buckets, taken = choice.buckets, [c for c in choice.compactions if c.compacted]
        before, after = model.evaluate([]), model.evaluate(buckets, taken)
        program_before, program_after = model.evaluate([], terms=False), model.evaluate(buckets, taken, terms=False)
        life_of = storage_of(model.lives)
        saved_before = sum(life.nbytes for life in {life_of[n].name: life_of[n] for n in saved_names}.values())
        saved_after = (saved_before - sum(life_of[n].nbytes for b in buckets for n in b.members)
                       + sum(b.shard_nbytes for b in buckets) - sum(c.freed_bytes for c in taken))
        empty = self._empty_plan(setup, shards)
        plan = dataclasses.replace(
            empty, decisions=choice.decisions, saved_bytes_before=saved_before,
            saved_bytes_after=saved_after, peak_bytes_before=before.peak_bytes, peak_bytes_after=after.peak_bytes,
            program_peak_bytes_before=program_before.peak_bytes, program_peak_bytes_after=program_after.peak_bytes,
            terms=list(model.terms), timeline_before=before, timeline_after=after, buckets=buckets,
            agreed=list(agreed.values), notes=[*empty.notes, *choice.notes], compactions=choice.compactions,
            budget_bytes=o.budget_bytes if o.policy == "budget" else None,
            budget_target_bytes=budget_target(o.budget_bytes) if o.policy == "budget" else None,
        )
        for warning in choice.warnings:
            warnings.warn(f"{type(self).__name__}: {warning}", stacklevel=3)
        proxy_of = {c.name: c.proxy for c in candidates}
        by_op: dict[int, list[BucketRequest]] = {}
        for b in buckets:
            by_op.setdefault(b.shard_op, []).append(
                BucketRequest(tuple(proxy_of[n] for n in b.members), b.shard_offset, b.shard_nbytes))
        op_nbytes = shard_op_nbytes(buckets)
        return plan, model, [ShardOpRequest(tuple(rs), op_nbytes[op]) for op, rs in by_op.items()]

    def _record(self, plan: ShardPlan) -> None:
        self.plans.append(plan)
        log.info("%s", plan)


class CompactSavedViews(ShardIntermediates):
    """Compaction of saved views alone, without any distributed setup or sharding (one GPU, any Thunder program): each
    saved view that keeps a larger storage alive is replaced by a compact copy of itself, made right after the
    storage's last forward use, where the copy frees at least as many bytes as it copies (see
    :mod:`thunder_fp8shard.compaction`; LitGPT's ``v`` under Thunder's benchmark executors). Gradients are bitwise
    those of the run without it. Use it as the last transform: ``thunder.jit(model, transforms=[CompactSavedViews()])``.
    ``ShardIntermediates`` compacts too (``compact="auto"``, its default): use one of the two.

    Options (keyword-only): ``min_bytes`` (compactions freeing fewer bytes are left out), ``policy`` (``"all"``: every
    compaction that does not raise the predicted peak; ``"peak"``: those lowering it; ``"budget"``: the fewest bytes
    copied that bring it to ``budget_bytes``), and the memory terms ``resident_bytes``, ``optimizer_states``,
    ``loss_bytes`` as for ``ShardIntermediates``. ``plans`` holds a :class:`~thunder_fp8shard.plan.ShardPlan` per
    compilation, whose compaction table lists what was compacted and why.
    """

    def __init__(self, *, min_bytes: int = 1024, policy: str = "all", budget_bytes: int | None = None,
                 resident_bytes: int | None = None, optimizer_states: int | None = None,
                 loss_bytes: int | None = None):
        super().__init__(min_bytes=min_bytes, policy=policy, budget_bytes=budget_bytes, resident_bytes=resident_bytes,
                         optimizer_states=optimizer_states, loss_bytes=loss_bytes)

    def _setup(self) -> tuple[None, None]:
        return None, None


def _check_last_post_optimization_transform(me: ShardIntermediates) -> None:
    transforms = list(getattr(get_compile_data(), "transforms", None) or [])
    later = transforms[transforms.index(me) + 1 :] if me in transforms else []
    hooked = [t for t in later if type(t).transform_trace_post_optimization is not Transform.transform_trace_post_optimization]
    if hooked:
        raise RuntimeError(
            f"{type(me).__name__} must be the last transform with a post-optimization step (it completes the forward "
            f"trace when it sees the backward); move it after {', '.join(type(t).__name__ for t in hooked)}"
        )
