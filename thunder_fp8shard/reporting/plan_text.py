"""A plan in words, with what its run-time checks found; ``ShardIntermediates.describe()`` prints it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from thunder_fp8shard.plan import MODELLED, ShardPlan
from thunder_fp8shard.format import fmt_bytes, table

if TYPE_CHECKING:  # pragma: no cover
    from thunder_fp8shard.runtime.run_report import RunReport


def plan_text(plan: ShardPlan, report: RunReport | None = None) -> str:
    """``plan`` as text: the verdict, each candidate and why it was or was not sharded, the compactions,
    the bytes and calls a step, and the memory model. With ``report``, the prediction as the audit corrected it and
    what the run-time checks found."""
    if report is not None:
        plan = report.corrected(plan)
    header = ("tensor", "shape", "dtype", "kind", "bytes", "replicated", "sharded", "reason")
    rows = [
        (d.name, "x".join(map(str, d.shape)) or "()", d.dtype, d.kind, f"{d.nbytes:,}",
         "yes" if d.replicated else "no", ("input" if d.shard_source else f"1/{plan.k}") if d.sharded else "no",
         d.reason)
        for d in plan.decisions
    ]
    if plan.shard_group_origin == "none":  # CompactSavedViews: no distributed setup
        lines = [f"CompactSavedViews plan: no distributed setup, nothing sharded, policy {plan.policy}; the pass "
                 f"took {plan.pass_seconds:.2f} s"]
    else:
        lines = [
            f"ShardIntermediates plan: {plan.integration or 'no distributed setup'}, world size {plan.world_size}, "
            f"{_shard_group_words(plan)}, method {plan.method}, policy {plan.policy}, "
            f"prefetch {plan.prefetch}; {len(plan.sharded)} of {len(plan.decisions)} candidates sharded, "
            + (f"in {len(plan.buckets)} bucket(s) of at most {fmt_bytes(plan.bucket_bytes)} kept by "
               f"{_shard_op_words(plan)}" if plan.bucket_bytes else "one tensor a bucket")
            + f", on {_group_words(plan)}; the pass took {plan.pass_seconds:.2f} s",
            *table(header, rows),
        ]
    lines[1:1] = [verdict(plan), *([plan.no_candidates] if plan.no_candidates else [])]
    lines += [
        *_compaction_table(plan),
        f"saved for backward per rank: {fmt_bytes(plan.saved_bytes_before)} -> {fmt_bytes(plan.saved_bytes_after)}",
        f"all-gathered per rank per step (received in backward, (k-1)/k of the gathered buffers): "
        f"{fmt_bytes(plan.gathered_bytes_per_step)}" + (" (and as much reduce-scattered in forward)"
                                                        if plan.method == "reduce_scatter" and plan.buckets else ""),
    ]
    if calls := plan.operator_calls:
        lines.append(f"run-time operator calls per step: {sum(calls.values())} ("
                     + ", ".join(f"{n} {name}" for name, n in calls.items() if n) + ")"
                     + (f"; the first steps also call the first-call checks ("
                        + ", ".join(f"{n} {name}" for name, n in plan.check_calls.items() if n)
                        + "), removed from the program once done (at the end of the calibration step)"
                        if any(plan.check_calls.values()) else ""))
    if plan.peak_bytes_before is not None and plan.peak_bytes_after is not None:
        lines += _terms_table(plan)
        lines += _agreed_table(plan)
        lines.append(
            f"predicted peak per rank:     {fmt_bytes(plan.peak_bytes_before)} -> {fmt_bytes(plan.peak_bytes_after)}"
            + _peak_where(plan.timeline_before, plan.timeline_after)
            + (f", WITHOUT {len(plan.left_out)} term(s) of unknown size:" if plan.left_out else "")
        )
        lines += [f"  leaves out the {t.name}: {t.how}" for t in plan.left_out]
    if t := plan.budget_traffic:
        bound = t.lower_bound_bytes
        lines.append(f"budget: the choice moves {fmt_bytes(t.moved_bytes)} a step (shards' payloads, compactions' "
                     "copies); " + ("no choice meeting the target can move less than "
                                    f"{fmt_bytes(bound)}" if bound is not None else "no choice can meet the target"))
    lines += _forward_gather_lines(plan)
    if report is not None:
        lines += run_time_lines(report)
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def verdict(plan: ShardPlan) -> str:
    """One line: the predicted peak and the bytes saved for backward, before -> after, and whether they fell."""
    saved = f"saved for backward {_change(plan.saved_bytes_before, plan.saved_bytes_after)}"
    if not plan.sharded and not plan.compacted:
        peak = (f"predicted peak {fmt_bytes(plan.peak_bytes_before)} and " if plan.peak_bytes_before is not None
                else "")
        return f"verdict: nothing sharded or compacted: {peak}saved for backward " \
               f"{fmt_bytes(plan.saved_bytes_before)} unchanged"
    if plan.peak_bytes_before is None or plan.peak_bytes_after is None:
        return f"verdict: {saved}"
    return f"verdict: predicted peak {_change(plan.peak_bytes_before, plan.peak_bytes_after)}; {saved}"


def peak_words(plan: ShardPlan) -> str:
    """The predicted peak's change in words, e.g. "falls by 1.2 MiB", "unchanged", "RISES by 8.0 KiB"."""
    if plan.peak_bytes_before is None or plan.peak_bytes_after is None:
        return "not predicted"
    return _direction(plan.peak_bytes_before, plan.peak_bytes_after)


def run_time_lines(report: RunReport) -> list[str]:
    """What the run-time checks found (see :mod:`thunder_fp8shard.runtime.audit`), once they ran."""
    out = []
    if (a := report.saved) is not None:
        out.append(f"saved at the first call (measured): {fmt_bytes(a.measured_saved_bytes)}, modelled "
                   f"{fmt_bytes(a.predicted_saved_bytes)}" + (
                       f"; {len(a.differences)} storage(s) differ (the term 'saved storages at the first call')"
                       if a.differences else ""))
    if (c := report.calibration) is not None:
        grown = "" if c.resident_growth_bytes is None else (
            f" = {fmt_bytes(c.compiled_peak_bytes)} at compilation {c.resident_growth_bytes:+,} B that the resident "
            "memory grew since beyond the plan's terms (the optimizer's state, unless optimizer_states said it)")
        out.append(f"calibration ({c.at}): device peak {fmt_bytes(c.measured_peak_bytes)}, predicted "
                   f"{fmt_bytes(c.predicted_peak_bytes)}{grown}, error {c.error_bytes:+,} B "
                   f"({c.error_pct:+.2f}%)" + (", over the budget: replanned at the next call"
                                                if c.budget_missed else ""))
        if c.capacity_bytes is not None:
            cap = "the device's" if c.memory_fraction >= 1 else (
                f"the cap set on this process ({c.memory_fraction:.4g} of the device's {fmt_bytes(c.total_bytes)})")
            out.append(f"capacity: {fmt_bytes(c.capacity_bytes)}, {cap}; headroom at the peak "
                       f"{fmt_bytes(c.capacity_bytes - c.measured_peak_bytes)} allocated, "
                       f"{fmt_bytes(c.capacity_bytes - c.reserved_peak_bytes)} reserved (the allocator's cache, which a "
                       "cap limits: a step runs out of memory when it cannot grow)")
    if report.checks_removed is not None:
        out.append(f"first-call checks: {report.checks_removed}")
    if report.runs_per_step and report.runs_per_step > 1:
        out.append(f"this program ran {report.runs_per_step} times in the first step (one subgraph serving "
                   f"{report.runs_per_step} blocks): its bytes count {report.runs_per_step} times a step")
    return out


def _compaction_table(plan: ShardPlan) -> list[str]:
    """The compaction options: each storage, its saved views, what a compact copy frees and copies, and why."""
    if not plan.compactions:
        return []
    header = ("storage", "saved views", "storage bytes", "freed", "copied a step", "compacted", "reason")
    rows = [(c.storage, ", ".join(f"{m} {'x'.join(map(str, sh))} {dt}" for m, sh, dt in zip(c.members, c.shapes,
                                                                                           c.dtypes)),
             f"{c.storage_nbytes:,}", f"{c.freed_bytes:,}", f"{c.copied_bytes:,}", "yes" if c.compacted else "no",
             c.reason) for c in plan.compactions]
    taken = plan.compacted
    head = (f"compaction of saved views: {len(taken)} of {len(plan.compactions)} storages compacted, "
            f"{fmt_bytes(sum(c.freed_bytes for c in taken))} freed, {fmt_bytes(plan.compacted_bytes_per_step)} "
            "copied a step")
    return [head, *table(header, rows)]


def _forward_gather_lines(plan: ShardPlan) -> list[str]:
    """fp8_forward_gather: each TE linear weight's forward all-gather, FP8 or bf16 and why, and the totals."""
    if not plan.forward_gather:
        return []
    (rb, ra), (cb, ca) = plan.forward_gather_bytes, plan.forward_cast_elements
    head = (f"forward all-gather of TE linear weights (fp8_forward_gather): "
            f"{sum(g.fp8 for g in plan.forward_gather)} of {len(plan.forward_gather)} in FP8; received per rank "
            f"{fmt_bytes(rb)} -> {fmt_bytes(ra)}, weight elements cast per rank {cb:,} -> {ca:,}"
            + (f"; run-time calls for them {plan.forward_gather_calls[0]} -> {plan.forward_gather_calls[1]}"
               if any(plan.forward_gather_calls) else ""))
    rows = [(g.weight, "x".join(map(str, g.shape)), "fp8" if g.fp8 else "bf16", f"{g.received_bytes_after:,}",
             g.reason) for g in plan.forward_gather]
    return [head, *table(("weight", "shape", "gathered as", "received bytes", "reason"), rows)]


def _shard_op_words(plan: ShardPlan) -> str:
    """How many shard ops keep the buckets' shards, how many buckets' shards are forward inputs instead, and what
    stopped each merge of consecutive shard ops (the op numbers of the buckets they did not take)."""
    own = sum(len(b.sources) for b in plan.buckets)
    ops = len({b.shard_op for b in plan.buckets if not b.sources})
    stops: dict[str, list[str]] = {}
    for b in plan.buckets:
        if b.merge_stop:
            stops.setdefault(b.merge_stop, []).append(str(b.shard_op))
    return f"{ops} shard op(s)" + (f" and {own} parameter shard(s) the forward all-gathered (no copy)" if own else "") \
        + ("; merges stopped by: " + ", ".join(f"{why} {len(at)} (before op {', '.join(at)})"
                                             for why, at in stops.items()) if stops else "")


def _shard_group_words(plan: ShardPlan) -> str:
    k, n = plan.k, plan.world_size
    ranks = f" (this rank: {_fmt_ranks(plan.shard_ranks)})" if plan.shard_ranks else ""
    which = "the whole group" if k == n else f"subgroups of k={k} ranks"
    return f"shards over {which}{ranks}: each copy keeps 1/{k}, saving {k - 1}/{k} of it"


def _group_words(plan: ShardPlan) -> str:
    return {"own": "the setup's process group", "dedicated": "a dedicated process group over the setup's ranks",
            "partition": f"process groups the pass made over runs of {plan.k} consecutive ranks"}[plan.shard_group_origin]


def _terms_table(plan: ShardPlan) -> list[str]:
    """The memory model's terms: the program's own peak, then each term outside it with its source."""
    if plan.program_peak_bytes_before is None:
        return []
    n = len(plan.timeline_before.steps) if plan.timeline_before is not None else 0
    rows = [("jitted program (its peak)", f"{plan.program_peak_bytes_before:,} -> {plan.program_peak_bytes_after:,}",
             "", MODELLED, "liveness of the joint forward+backward program")]
    rows += [(t.name, f"{t.nbytes:,}", t.where(n), t.source, t.how) for t in plan.terms]
    return table(("memory model (device bytes per rank)", "bytes", "steps", "source", "how"), rows)


def _agreed_table(plan: ShardPlan) -> list[str]:
    """The inputs agreed across the ranks before planning: the value planned with against this rank's own."""
    if not plan.agreed:
        return []
    rows = [(a.name, a.rule, f"{a.value:,}", f"{a.own:,}", "" if a.value == a.own else "another rank's")
            for a in plan.agreed]
    return table((f"agreed over {plan.k} ranks before planning", "rule", "planned with", "this rank's own", ""), rows)


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
