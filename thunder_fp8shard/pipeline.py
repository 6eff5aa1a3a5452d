"""The pass's stages in order, as one function of a compilation's traces: :func:`compile_plan` analyzes the joint
program (:mod:`thunder_fp8shard.analysis`), agrees the per-rank inputs (:mod:`thunder_fp8shard.distributed`), plans
(:mod:`thunder_fp8shard.planning`), checks that every rank planned the same collectives, rewrites the traces
(:mod:`thunder_fp8shard.rewrite`) and arms the run-time checks (:mod:`thunder_fp8shard.runtime`). It reads and
writes nothing of Thunder's: the transform (:mod:`thunder_fp8shard.transform`) hands it the traces and what it read
while compiling, and installs what it returns. Its only effects are the collectives of the agreement and the check,
over the shard group it is given. What it reads of the world (the device, the other ranks) and the two decisions the
tests plant wrong on purpose come in as :class:`Seams`, never as patched module globals.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

from thunder.core.proxies import TensorProxy
from thunder.core.trace import TraceCtx

from thunder_fp8shard.analysis.analyze import Analysis, analyze
from thunder_fp8shard.analysis.replication import analyze_replication
from thunder_fp8shard.analysis.program import ProgramFacts, program_facts
from thunder_fp8shard.analysis.saved import backward_saved
from thunder_fp8shard.distributed.agreement import TORCH_COLLECTIVES, Collectives, agree, check, largest
from thunder_fp8shard.distributed.integrations import Integration
from thunder_fp8shard.distributed.shard_groups import ShardGroup
from thunder_fp8shard.memory.device import DeviceMemory, DeviceProbe
from thunder_fp8shard.options import ShardOptions
from thunder_fp8shard.plan import ShardPlan
from thunder_fp8shard.planning.planner import choose, make_plan
from thunder_fp8shard.reporting.format import fmt_bytes
from thunder_fp8shard.rewrite import collective_schedule, fp8_gather
from thunder_fp8shard.rewrite.traces import operator_calls, requests, rewrite_backward, rewrite_forward, with_run_checks
from thunder_fp8shard.runtime.audit import Calibration, SavedAudit, calibration_term, expected_storages
from thunder_fp8shard.runtime.run_report import RunReport
from thunder_fp8shard.runtime.steady_state import CHECK_NAMES


@dataclass(frozen=True)
class Seams:
    """What the pass reads of the world, and the two choices a test plants wrong on purpose; injected into the
    transform (``ShardIntermediates.inject(...)``), which passes them to :func:`compile_plan`."""

    device_probe: DeviceProbe = field(default_factory=DeviceProbe)  # the device's allocator, while compiling and at
    # the calibration step
    collectives: Collectives = TORCH_COLLECTIVES  # the agreement's and the check's, over the shard group
    replication_analysis: Callable = analyze_replication  # which tensors are identical on every rank
    chooser: Callable = choose  # the planner's choice of shards and compactions


@dataclass(frozen=True)
class Compiled:
    """What :func:`compile_plan` returns: the plan (final, frozen), the report its run-time checks write, and the
    traces to run (with the first-call checks)."""

    plan: ShardPlan
    report: RunReport
    forward: TraceCtx
    backward: TraceCtx
    calibration: Calibration  # the backward's check; the caller sets ``on_done`` (it drops the checks from Thunder's cache)


@dataclass(frozen=True)
class _Planned:
    """One program's plan, before any collective of the plan: the forward and backward, their facts, the FP8
    forward-gather decisions, the analysis with the agreed terms, the plan and the planner's warnings."""

    forward: TraceCtx
    backward: TraceCtx
    facts: ProgramFacts
    fwd_gather: fp8_gather.ForwardGatherPlan
    analysis: Analysis
    plan: ShardPlan
    warnings: tuple[str, ...]


def _planned(fw: TraceCtx, *, bw: TraceCtx, options: ShardOptions, setup, shards, device, te_names,
             calibration_bytes, name: str, seams: Seams) -> _Planned:
    """Analyzes the program ``fw`` + ``bw``, agrees its inputs over the shard group and plans it (pure but for the
    agreement's collectives, which every rank runs alike)."""
    o = options
    group = shards.group if shards is not None else None
    k = shards.size if shards is not None else 1
    # which TE weights the forward all-gathers in FP8: decided on the traces alone, before the memory model, which
    # counts their gathered buffers at the bytes the rewrite makes them
    fwd_gather = fp8_gather.plan(fw, bw, enabled=o.fp8_forward_gather, setup_name=setup and setup.name,
                                 group=setup and setup.group, world_size=setup.world_size if setup else 1)
    facts = program_facts(fw, bw, te_names)  # derived once; every stage reads them
    if len(backward_saved(bw)[0]) != len(facts.saved):
        raise RuntimeError(f"{name}: the backward trace does not match the forward it follows")
    extra = (calibration_term(calibration_bytes, facts.last_step),) if calibration_bytes else ()
    analysis = analyze(facts, o, setup, device, extra, replication_analysis=seams.replication_analysis,
                       resized=fwd_gather.buffer_nbytes(), shard_ranks=tuple(shards.ranks) if shards else ())
    # the same inputs, hence the same plan, on every rank that runs the plan's collectives with this one
    agreed = agree(analysis.model.terms, o.budget_bytes, group, seams.collectives)
    analysis = analysis.with_terms(agreed.terms)
    plan, warns = make_plan(analysis, dataclasses.replace(o, budget_bytes=agreed.budget_bytes), k,
                            plan_header(o, setup, shards), agreed.values, chooser=seams.chooser)
    return _Planned(fw, bw, facts, fwd_gather, analysis, plan, tuple(warns))


def _rescheduled(first: _Planned, planned: Callable[..., _Planned]) -> _Planned | None:
    """The plan of the program with Thunder FSDP's collectives rescheduled
    (:mod:`thunder_fp8shard.rewrite.collective_schedule`: the forward's all-gathers issued a few ahead of their use,
    each gradient's reduce-scatter right after the gradient), if the memory model predicts it a lower peak; its
    "before" stays the run without the pass (Thunder's order). None: Thunder's order is kept. The choice depends
    only on the agreed plans: every rank makes the same."""
    fw = collective_schedule.schedule_forward(first.forward)
    bw = collective_schedule.schedule_backward(first.backward)
    if fw is None and bw is None:
        return None
    second = planned(fw or first.forward, bw=bw or first.backward)
    plan = first.plan
    if second.plan.peak_bytes_after >= plan.peak_bytes_after:
        return None
    moved = " and ".join(w for w, t in (("the forward's all-gathers", fw), ("the gradients' reduce-scatters", bw)) if t)
    note = (f"reschedule: {moved} moved where they hold less memory (Thunder FSDP's order keeps every gathered "
            f"weight, or every unsharded gradient, alive at once): predicted peak {fmt_bytes(plan.peak_bytes_after)} "
            f"-> {fmt_bytes(second.plan.peak_bytes_after)}")
    return dataclasses.replace(second, plan=dataclasses.replace(
        second.plan, peak_bytes_before=plan.peak_bytes_before, timeline_before=plan.timeline_before,
        program_peak_bytes_before=plan.program_peak_bytes_before, notes=(*second.plan.notes, note)))


def plan_header(options: ShardOptions, setup: Integration | None, shards: ShardGroup | None) -> ShardPlan:
    """The plan's setup facts, nothing decided yet."""
    o = options
    common = dict(method=o.method, policy=o.policy, prefetch=o.prefetch, decisions=(), saved_bytes_before=0,
                  saved_bytes_after=0, bucket_bytes=o.bucket_bytes)
    if setup is None:  # compaction alone: no distributed setup
        return ShardPlan(world_size=1, comm="", integration="", shard_group_size=1, shard_group_origin="none", **common)
    return ShardPlan(world_size=setup.world_size, comm=o.comm, integration=setup.name, notes=tuple(setup.notes),
                     shard_group_size=shards.size, shard_ranks=shards.ranks, shard_group_origin=shards.origin, **common)


def compile_plan(fw: TraceCtx, bw: TraceCtx, options: ShardOptions, setup: Integration | None,
                 shards: ShardGroup | None, device: DeviceMemory | None, te_names: frozenset[str],
                 calibration_bytes: int | None, on_miss: Callable[[int], None], name: str = "ShardIntermediates",
                 seams: Seams = Seams()) -> Compiled:
    """Plans the program ``fw`` + ``bw`` and rewrites it. ``setup``: the distributed setup (None: compaction alone);
    ``shards``: this rank's shard group (the plan's collectives run on it); ``device``: what the device's allocator
    said while ``fw`` compiled (None on the CPU); ``te_names``: the forward's TransformerEngine quantized tensors;
    ``calibration_bytes``: a missed budget's error, planned with as a measured term; ``on_miss(error_bytes)``: what the
    calibration calls when the device misses the budget; ``name``: the transform's, in the traces' provenance;
    ``seams``: the device, the collectives and the two plantable choices. The program with Thunder FSDP's collectives
    rescheduled is planned too; where its predicted peak is lower it is kept with ``options.reschedule``, and named
    in a note of the plan without it."""
    o = options
    group = shards.group if shards is not None else None  # the shards' collectives: the shard group's
    k = shards.size if shards is not None else 1
    planned = functools.partial(_planned, options=o, setup=setup, shards=shards, device=device,
                                te_names=te_names, calibration_bytes=calibration_bytes, name=name, seams=seams)
    chosen = planned(fw, bw=bw)
    scheduled = _rescheduled(chosen, planned) if setup is not None else None
    if scheduled is not None and o.reschedule:
        chosen = scheduled
    elif scheduled is not None:  # said, not done: the option is off (every rank planned both alike)
        lower = scheduled.plan.peak_bytes_after
        chosen = dataclasses.replace(chosen, plan=dataclasses.replace(chosen.plan, notes=(
            *chosen.plan.notes, f"reschedule=True would lower the predicted peak {fmt_bytes(chosen.plan.peak_bytes_after)} "
            f"-> {fmt_bytes(lower)} (Thunder FSDP's all-gathers issued ahead of their use, each gradient's reduce-scatter "
            "right after it: docs/options.md)")))
    fw, bw = chosen.forward, chosen.backward
    facts, fwd_gather, analysis, plan = chosen.facts, chosen.fwd_gather, chosen.analysis, chosen.plan
    for warning in chosen.warnings:
        warnings.warn(f"{name}: {warning}", stacklevel=3)
    plan = dataclasses.replace(plan, forward_gather=tuple(fwd_gather.rows), notes=(*plan.notes, *fwd_gather.notes))
    if group is not None:
        check(plan, group, verify=o.verify, comm=seams.collectives)  # before any collective of the plan
    shard_ops, compactions = requests(plan, facts)
    n = sum(len(r.members) for op in shard_ops for r in op.buckets)
    new_fw = rewrite_forward(
        facts, shard_ops, group=group, k=k, method=o.method, verify=o.verify, compactions=compactions,
        provenance=f"{name}: {n} saved tensors kept as 1/{k} shards of {len(plan.buckets)} "
        f"bucket(s) by {len(shard_ops)} shard op(s) ({o.method}), {len(compactions)} compaction(s)",
    )
    new_bw, _ = rewrite_backward(
        bw, new_fw, group=group, provenance=f"{name}: {len(plan.buckets)} bucket(s) all-gathered (prefetch {o.prefetch})",
    )
    report = RunReport()  # written by the two checks only, at run time; they read the plan's prediction, final here
    audit = SavedAudit(plan, report, expected_storages(analysis.model, plan, new_fw),
                       [p.name for p in new_fw.saved if isinstance(p, TensorProxy)])
    calibration = Calibration(plan, report, facts.device, plan.budget_bytes,
                              functools.partial(largest, group=group, comm=seams.collectives), on_miss, audit,
                              peak=seams.device_probe.peak_allocated)
    new_fw = dataclasses.replace(new_fw, trace=fwd_gather.apply(new_fw.trace))  # the saved list is unchanged
    fw_trace, new_bw = with_run_checks(new_fw, new_bw, audit, calibration)
    calls = operator_calls(fw_trace, new_bw)
    gather_calls = fp8_gather.operator_calls(fw_trace) if fwd_gather.sites else {}
    plan = dataclasses.replace(  # the plan as the traces to run have it: final from here on
        plan, operator_calls={**{op: n for op, n in calls.items() if op not in CHECK_NAMES}, **gather_calls},
        check_calls={op: calls[op] for op in CHECK_NAMES},
        forward_gather_calls=(fwd_gather.calls_replaced, sum(gather_calls.values())) if fwd_gather.sites else (0, 0))
    return Compiled(plan, report, fw_trace, new_bw, calibration)
