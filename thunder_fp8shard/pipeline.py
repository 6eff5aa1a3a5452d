"""The pass's stages in order, as one function of a compilation's traces (:func:`compile_plan`), each phase run over the
rewrites (:data:`REWRITES`, or those given in ``Seams.rewrites``); a rewrite's variant of the program is planned too and
kept where it says (:func:`_variant`). It touches nothing of Thunder's; its only effects are the collectives over the
shard group. What it reads of the world, the rewrites it runs and the choices tests plant wrong come in as
:class:`Seams`, never as patched module globals.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from thunder.core.proxies import DistParallelType, TensorProxy
from thunder.core.trace import TraceCtx

from thunder_fp8shard.analysis.candidates import saved_bytes_by_dtype
from thunder_fp8shard.analysis.identity import program_key, tensor_keys
from thunder_fp8shard.analysis.replication import analyze_replication
from thunder_fp8shard.analysis.program import program_facts
from thunder_fp8shard.analysis.saved import backward_saved, forward_inputs
from thunder_fp8shard.distributed.agreement import (
    TORCH_COLLECTIVES, Collectives, agree, differing, largest, mismatch_message,
)
from thunder_fp8shard.distributed.layout import Layout, Layouts, first_difference, layout_of, signature
from thunder_fp8shard.distributed.integrations import Integration
from thunder_fp8shard.distributed.shard_groups import ShardGroup
from thunder_fp8shard.memory.device import DeviceMemory, DeviceProbe
from thunder_fp8shard.memory.model import gathers_hold_scratch, memory_model
from thunder_fp8shard.options import ShardOptions
from thunder_fp8shard.plan import ShardPlan
from thunder_fp8shard.planning.planner import Analysis, LayoutError, choose, choose_layout, decide
from thunder_fp8shard.rewrite.collective_schedule import RESCHEDULE
from thunder_fp8shard.rewrite.compact import COMPACTION
from thunder_fp8shard.rewrite.fp8_gather import FORWARD_GATHER
from thunder_fp8shard.rewrite.own_shards import OWN_SHARDS
from thunder_fp8shard.rewrite.shape import Effect, Program, Rewrite, Rewritten
from thunder_fp8shard.rewrite.shard import SHARD
from thunder_fp8shard.rewrite.traces import expected_storages, operator_calls, with_run_checks
from thunder_fp8shard.runtime.audit import Calibration, SavedAudit, StepClock, calibration_term
from thunder_fp8shard.runtime.run_report import RunReport
from thunder_fp8shard.runtime.steady_state import CHECK_NAMES


# the rewrites in the order each phase runs them: own shards and compaction find their sites from the shard's
# candidates, the FP8 forward gather rewrites the forward the shard rewrite made, reschedule offers a variant
REWRITES: tuple[Rewrite, ...] = (SHARD, OWN_SHARDS, COMPACTION, FORWARD_GATHER, RESCHEDULE)


@dataclass(frozen=True)
class Seams:
    """What the pass reads of the world, the rewrites it runs, and the two choices a test plants wrong on purpose
    (``ShardIntermediates.inject(...)``). ``rewrites``: :data:`REWRITES`, or a tuple with one's own in it (a
    :class:`~thunder_fp8shard.rewrite.shape.Rewrite`: docs/architecture.md, "Adding a rewrite")."""

    rewrites: tuple[Rewrite, ...] = REWRITES
    device_probe: DeviceProbe = field(default_factory=DeviceProbe)
    collectives: Collectives = TORCH_COLLECTIVES
    replication_analysis: Callable = analyze_replication
    chooser: Callable = choose  # the policy over the items, which planner.decide calls


@dataclass(frozen=True)
class Compiled:
    """What :func:`compile_plan` returns: the final plan, the report its run-time checks write, and the traces
    to run."""

    plan: ShardPlan
    report: RunReport
    forward: TraceCtx
    backward: TraceCtx
    calibration: Calibration  # the caller sets its ``on_done``


@dataclass(frozen=True)
class _Planned:
    """One program's decision and what it was made from, before any collective of the plan: the plan's fields as the
    header and each rewrite decided them (``decided``), from which :func:`_build` assembles the plan once."""

    program: Program
    decided: Mapping[str, Any]
    warnings: tuple[str, ...]
    keys: Mapping[str, str]

    @functools.cached_property
    def plan(self) -> ShardPlan:
        """The plan as decided, before the rewrite: what variants are compared on, and the run-time checks read."""
        return ShardPlan(**self.decided)


def _decided(fields: Mapping[str, Any], more: Mapping[str, Any], by: str) -> dict[str, Any]:
    """``fields`` and a rewrite's ``more``: its notes after those before, every other field set once."""
    if twice := set(more).intersection(fields) - {"notes"}:
        raise AssertionError(f"rewrite {by!r} decides the plan's {sorted(twice)}, which another decided")
    return {**fields, **more, "notes": (*fields.get("notes", ()), *more.get("notes", ()))}


def found(program: Program, rewrites: tuple[Rewrite, ...] = REWRITES) -> tuple[Program, Effect]:
    """Every rewrite's sites, in order, and their effect on the memory model."""
    for r in rewrites:
        if r.sites is not None:
            program = program.found(r.name, r.sites(program))
    effect = Effect()
    for r in rewrites:
        if r.effect is not None:
            effect = r.effect(program, effect)
    return program, effect


def analysis_of(program: Program, effect: Effect, device: DeviceMemory | None, extra_terms=(),
                replication_analysis: Callable = analyze_replication) -> Analysis:
    """The memory model of ``effect`` (``device``: read while compiling, None on the CPU; ``extra_terms``: measured
    at run time) and the replication verdicts over the setup's group."""
    facts, setup = program.facts, program.setup
    model = memory_model(facts, list(effect.candidates), options=program.options, device=device,
                         gather_scratch=setup is not None and gathers_hold_scratch(setup.group, facts.device),
                         resized=effect.resized, compactions=effect.compactions)
    if extra_terms:
        model = dataclasses.replace(model, terms=(*model.terms, *extra_terms))
    fw = facts.forward
    replication = None if setup is None else replication_analysis(fw, setup.group, setup.replicated_inputs(fw),
                                                                   setup.input_reasons(fw))
    return Analysis(tuple(effect.candidates), model, replication, facts.saved_names, facts.model_io,
                    saved_bytes_by_dtype(facts.saved, facts.te_names), effect.sources, effect.defaults)


def _planned(fw: TraceCtx, *, bw: TraceCtx, options: ShardOptions, setup, shards, device, te_names,
             calibration_bytes, name: str, seams: Seams, together, forced: Layout | None = None,
             variant: str = "", alone: bool = False) -> _Planned:
    """Analyzes and plans ``fw`` + ``bw`` with the inputs agreed over ``together``, or realizes the agreed
    layout ``forced`` with no collective (this rank's inputs then decide only the rank-local compactions)."""
    o = options
    facts = program_facts(fw, bw, te_names)
    if len(backward_saved(bw)[0]) != len(facts.saved):
        raise RuntimeError(f"{name}: the backward trace does not match the forward it follows")
    program, effect = found(Program(
        facts, o, setup, shard_ranks=tuple(shards.ranks) if shards else (), k=shards.size if shards is not None else 1,
        group=shards.group if shards is not None else None, name=name, together=not alone,
        variant=variant), seams.rewrites)
    extra = (calibration_term(calibration_bytes, facts.last_step),) if calibration_bytes else ()
    analysis = analysis_of(program, effect, device, extra, seams.replication_analysis)
    keys = tensor_keys(fw, analysis.replication.replicated) if analysis.replication is not None else {}
    budget, values, chooser = o.budget_bytes, (), seams.chooser
    if forced is None:  # the same inputs, hence the same plan, on every rank
        agreed = agree(analysis.model.terms, o.budget_bytes, together, seams.collectives)
        analysis = dataclasses.replace(analysis, model=dataclasses.replace(analysis.model, terms=tuple(agreed.terms)))
        budget, values = agreed.budget_bytes, agreed.values
    else:
        names = {key: n for n, key in keys.items()}
        chooser = functools.partial(choose_layout, buckets=[[names.get(key, key) for key in b] for b in forced.buckets],
                                    ops=forced.shard_ops)
    o = dataclasses.replace(o, budget_bytes=budget)
    program = dataclasses.replace(program, options=o, analysis=analysis, agreed=values,
                                  choice=decide(analysis, o, program.k, chooser))  # the one decision
    decided, warns = plan_header(o, setup, shards), tuple(program.choice.warnings)
    for r in seams.rewrites:
        if r.decide is not None:
            fields, more = r.decide(program)
            decided, warns = _decided(decided, fields, r.name), warns + tuple(more)
    return _Planned(program, decided, warns, keys)


def _variant(first: _Planned, planned: Callable[..., _Planned], rewrites: tuple[Rewrite, ...],
             forced: Layout | None = None) -> _Planned:
    """The plan to build: ``first``'s, or a rewrite's variant of its program where the rewrite keeps it (its "before"
    stays the program's). Only the rewrites that offer one plan a second program. Every rank chooses alike: the choice
    depends only on the agreed plans; ``forced``: the agreed layout says which."""
    for r in rewrites:
        if r.variant is None or (forced is not None and forced.variant != r.name):
            continue
        traces = r.variant(first.program)
        if traces is None:
            continue
        second = planned(traces[0], bw=traces[1], variant=r.name, forced=forced)
        note = f"{r.name}: as the model's agreed layout" if forced is not None else r.keep(
            first.program, traces, first.plan, second.plan)
        if note is not None:  # the variant, with the program's plan as its "before", and the note
            before = ("peak_bytes_before", "timeline_before", "program_peak_bytes_before")
            return dataclasses.replace(second, decided={**second.decided, "notes": (*second.decided["notes"], note),
                                                        **{f: getattr(first.plan, f) for f in before}})
    return first


def plan_header(options: ShardOptions, setup: Integration | None, shards: ShardGroup | None) -> dict[str, Any]:
    """The plan's setup facts (its fields), nothing decided yet."""
    o = options
    common = dict(method=o.method, policy=o.policy, prefetch=o.prefetch, bucket_bytes=o.bucket_bytes)
    if setup is None:  # compaction alone: no distributed setup
        return dict(world_size=1, comm="", integration="", shard_group_size=1, shard_group_origin="none", notes=(),
                    **common)
    return dict(world_size=setup.world_size, comm=o.comm, integration=setup.name, shard_group_size=shards.size,
                shard_ranks=shards.ranks, shard_group_origin=shards.origin, notes=tuple(setup.notes), **common)


@dataclass(frozen=True)
class _Built:
    """A planned program rewritten, the collectives it issues, and its layout."""

    compiled: Compiled
    signature: tuple[str, ...]
    layout: Layout


def _build(chosen: _Planned, *, clock: StepClock, on_miss: Callable[[int], None], seams: Seams, started: float,
           notes: tuple[str, ...] = ()) -> _Built:
    """Rewrites ``chosen``'s program as its plan says, every rewrite in order, arms the run-time checks (no
    collective), and assembles the plan once: the decision, ``notes``, and what the rewritten program calls."""
    program, plan = chosen.program, chosen.plan
    for warning in chosen.warnings:
        warnings.warn(f"{program.name}: {warning}", stacklevel=4)
    rewritten = Rewritten(None, program.facts.backward)
    for r in seams.rewrites:
        if r.apply is not None:
            rewritten = r.apply(program, plan, rewritten)
    new_fw, new_bw = rewritten.forward, rewritten.backward
    report = RunReport()  # written only by the run-time checks
    audit = SavedAudit(plan, report, expected_storages(program.analysis.model, plan, new_fw),
                       [p.name for p in new_fw.saved if isinstance(p, TensorProxy)], clock)
    calibration = Calibration(plan, report, program.facts.device, plan.budget_bytes, clock, on_miss, audit,
                              probe=seams.device_probe)
    sig = signature(new_fw.trace, new_bw)
    fw_trace, new_bw = with_run_checks(new_fw, new_bw, audit, calibration)
    calls, counted = operator_calls(fw_trace, new_bw), {}
    for r in seams.rewrites:
        if r.count is not None:
            more, fields = r.count(program, fw_trace)
            calls, counted = {**calls, **more}, _decided(counted, fields, r.name)
    fields = _decided(chosen.decided, counted, "count")
    plan = ShardPlan(**{**fields, "notes": (*fields["notes"], *notes), "pass_seconds": time.perf_counter() - started,
                        "operator_calls": {op: n for op, n in calls.items() if op not in CHECK_NAMES},
                        "check_calls": {op: calls[op] for op in CHECK_NAMES}})
    layout = layout_of(plan, chosen.keys, program.variant, sig)
    return _Built(Compiled(plan, report, fw_trace, new_bw, calibration), sig, layout)


NOTHING = Layout()  # nothing sharded, Thunder's order


def agreement_group(setup: Integration | None, shards: ShardGroup | None):
    """Where the ranks agree a layout: the larger of the setup's group and the shard group; None with one rank
    or no setup."""
    if setup is None or shards is None:
        return None
    size, group = (shards.size, shards.group) if shards.size > setup.world_size else (setup.world_size, setup.group)
    return group if size > 1 else None


def compile_plan(fw: TraceCtx, bw: TraceCtx, options: ShardOptions, setup: Integration | None,
                 shards: ShardGroup | None, device: DeviceMemory | None, te_names: frozenset[str],
                 calibration_bytes: int | None, on_miss: Callable[[int], None], name: str = "ShardIntermediates",
                 seams: Seams = Seams(), layouts: Layouts | None = None, clock: StepClock | None = None,
                 started: float | None = None) -> Compiled:
    """Plans the program ``fw`` + ``bw`` and rewrites it (``setup`` None: compaction alone).

    While the ranks compile together the program is planned with agreed inputs and the ranks compare their layouts;
    where they differ, all realize rank 0's. A later compilation realizes its program's agreed layout with no
    collective, and raises where its collectives would differ."""
    layouts = layouts if layouts is not None else Layouts()
    clock = clock if clock is not None else StepClock()
    clock.allocated = functools.partial(seams.device_probe.allocated, device.device if device else None)  # no collective
    together = agreement_group(setup, shards)
    planned = functools.partial(_planned, options=options, setup=setup, shards=shards, device=device,
                                te_names=te_names, calibration_bytes=calibration_bytes, name=name, seams=seams,
                                together=together)
    build = functools.partial(_build, seams=seams, clock=clock, on_miss=on_miss,
                              started=time.perf_counter() if started is None else started)
    if setup is None:  # compaction alone: nothing collective
        return build(planned(fw, bw=bw)).compiled
    program = program_key(fw, parameters(fw, setup), bw)
    if layouts.open:
        built = _together(fw, bw, planned, build, together, seams.collectives, seams.rewrites)
        layouts.by_program[program] = built.layout
        clock.agree = functools.partial(largest, group=together, comm=seams.collectives)
        return built.compiled
    agreed = layouts.by_program.get(program)
    if agreed is None:
        # nothing sharded: what any rank compiling it alone does too
        return build(_forced(fw, bw, functools.partial(planned, alone=True), NOTHING, seams.rewrites), notes=(
            "a program the ranks did not compile together (none like it at the model's first compilation): left "
            "with Thunder's own collectives (nothing sharded, no forward gather in FP8)",)).compiled
    try:
        built = build(_forced(fw, bw, planned, agreed, seams.rewrites), notes=(
            "compiled on this rank alone (its own input shapes): the model's agreed layout, no collective",))
        why = None if built.signature == agreed.signature else first_difference(built.signature, agreed.signature)
    except LayoutError as e:
        why = str(e)
    if why is not None:
        raise RuntimeError(
            f"{name}: this rank compiled a program (its own input shapes) whose collectives differ from those the "
            f"ranks agreed for this model at its first compilation: {why}. Running it would hang or corrupt the "
            "gradients on every rank, so it does not run. Give every rank's input shapes the same code path, or "
            "leave the pass out.")
    return built.compiled


def parameters(fw: TraceCtx, setup: Integration) -> frozenset[str]:
    """The forward's inputs whose shapes are the model's, not the batch's: replicated inputs and Thunder
    FSDP's parameter shards."""
    sharded = {p.name for p in forward_inputs(fw)
               if getattr(p, "distparallel_type", None) == DistParallelType.FULLY_SHARDED}
    return frozenset(setup.replicated_inputs(fw)) | sharded


def _forced(fw: TraceCtx, bw: TraceCtx, planned: Callable[..., _Planned], layout: Layout,
            rewrites: tuple[Rewrite, ...]) -> _Planned:
    """The program planned to ``layout``, with no collective."""
    first = planned(fw, bw=bw, forced=layout)
    return _variant(first, planned, rewrites, forced=layout) if layout.variant else first


def _together(fw: TraceCtx, bw: TraceCtx, planned: Callable[..., _Planned], build: Callable[..., _Built], together,
              comm: Collectives, rewrites: tuple[Rewrite, ...]) -> _Built:
    """The program planned while every rank compiles, and the layout the ranks agree: this rank's where all
    are the same; else rank 0's everywhere, or nothing sharded where rank 0's would raise a rank's peak or cannot be
    realized there; where even that differs, every rank raises the same error."""
    built = build(_variant(planned(fw, bw=bw), planned, rewrites))
    if together is None:
        return built
    layouts = differing(built.layout, together, comm)
    if layouts is None:
        return built
    for layout, why in ((layouts[0], "rank 0's layout"), (NOTHING, "nothing sharded")):
        try:
            again = build(_forced(fw, bw, planned, layout, rewrites), notes=(
                f"the ranks compiled different programs at the first call (their own input shapes) and planned "
                f"different layouts: {why} on every rank",))
            plan = again.compiled.plan
            ok = layout is NOTHING or (again.signature == layout.signature
                                       and plan.peak_bytes_after <= plan.peak_bytes_before)
        except LayoutError:
            again, ok = None, False
        if comm.all_reduce_max([0 if ok else 1], together) == [0] and differing(again.layout, together, comm) is None:
            return again
    raise RuntimeError(mismatch_message([x.fields() for x in layouts], comm.ranks(together)))
