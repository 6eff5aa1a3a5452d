"""The paired benchmark: both sides in one process, their training iterations alternating, the overhead with a CI.

Separate launches of Thunder's harness cannot resolve a 1% cost on these machines (each launch, and each stretch of
one, runs at a speed of its own). Here every side ("arm") is built by Thunder's own ``Benchmark_litGPT`` from the
same flags as ``thunder/benchmarks/benchmark_litgpt.py`` (the pass appended to ``thunder.jit``'s transforms, or to
``ThunderCompiler``'s, while it compiles), in one process, and their iterations alternate in ABBA quads against the
first arm (the base): ``A B B A`` for each further arm in turn, so every iteration of an arm has a base iteration
beside it, and within a quad each side runs once after itself and once after the other. An iteration is the body of
``Benchmark_litGPT.train`` (gradient accumulation 1): the batch to the device, forward under the TE autocast, the
cross-entropy, backward, ``optimizer.step``, ``zero_grad(set_to_none=True)``, ``loss.item()``.

Per iteration it records the wall time, the process's CPU time, the allocator's counters (cudaMalloc and cudaFree
calls, retries), the peak allocated bytes, and Python's garbage collections. The overhead of an arm is the median of
its paired differences (each of its iterations minus the base iteration beside it, in the same quad) as a percentage
of the base's median, with a bootstrap 95% CI over the quads; the CPU time's overhead likewise. An arm without the
pass (``null``) is the A/A check of the instrument: its CI must contain 0.

Ranks: ``--simulate N`` makes this one process rank 0 of N in torch's fake process group (nothing is communicated,
so the times have **no communication** in them, and the memory is rank 0's); without it, run under ``torchrun`` with
NCCL, one GPU a rank (every rank runs the same schedule; rank 0 writes). Simulated, every collective of the step
(FSDP's, TE's amax all-reduces, the pass's) writes its output with one kernel on the current stream, as NCCL launches
one (``--sim-collectives one-kernel``, :mod:`benchlib.collectives`); ``--sim-collectives fake-group`` keeps the fake
group's own (an all-gather N copies, an all-reduce or a reduce-scatter nothing). The JSON's ``"sim_collectives"``
says which ran.

Where the pass's CPU goes (``--decompose-iters K``, default 5): after the timed iterations, K more rounds of each arm,
the pass's operators and the Thunder operators it replaces or adds to timed inside the compiled programs
(:mod:`benchlib.op_timer`); each comparison's ``"pass_cpu"`` and ``"pass_cpu_ms_per_step"``: the net CPU ms a step
the pass adds on those operators (the arm's ms a step less the base's, summed), the gross (its own operators alone),
and the breakdown by operator (``benchmarks/time_cpu.py ops`` prints them).

An arm's options may name a git ``"revision"``: that arm runs that revision's pass (its package extracted with
``git archive`` and imported under another name beside this checkout's), so two versions of the pass are compared in
one process. ``"budget_below_base_bytes": B`` (with ``"policy": "budget"``, on CUDA) sets the arm's ``budget_bytes``
to B under the device peak its step would reach without the pass in this process (:func:`relative_budget`: the
base arm's step peak on top of what is resident when the arm is built); its JSON says whether every timed
iteration's peak met it. ``--device cpu`` runs Thunder's benchmark on the CPU (small litgpt configs, e.g.
``--model_name=pythia-14m --n_layers=2 --block_size=64 --compile=thunder``; with ``--simulate``): the pass's CPU
cost in a whole step, on any machine.

One JSON per comparison (``<out>_<arm>.json``: ``"kind": "paired"``, ``"null"``, ``"overhead_pct"``, ...), and
the log's last lines are a table. Usage (one H200, simulated 8 ranks)::

    python benchmarks/paired.py --simulate 8 --arms '{"without": null, "with": {"optimizer_states": 2}, "null": null}' \\
        --timed 100 --out benchmarks/results/paired_fp8_l32_n8 -- --distributed_mode=fsdp --shard_mode=zero3 \\
        --model_name=Llama-2-7b-hf --micro_batch_size=1 --compile=thunder_inductor_cat \\
        --low_precision_mode=fp8-default-te --n_layers=32

``--one-model``: one model is built and compiled (the base); every other arm is a program of it, the base's traces
before the pass rewritten by the arm's own pass (:mod:`benchlib.shared_compile`): seconds an arm instead of a
compilation, and every arm's step in the same resident memory. Without it, each arm is a model of its own.

``--timed`` is the number of timed iterations of each non-base arm (the base runs as many for each comparison).
The arms without the pass are built first, so that each compilation of the pass measures the others' resident
memory, which every iteration's peak includes.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gc
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

from benchlib import ROOT, shared_compile
from benchlib.patches import on_the_cpu, pass_appended, pass_gathers_on_their_own_stream, simulate
from benchlib.reporting import accuracy_reports, device_name, flag, plan_summary, results_table, split_argv
from benchlib.revisions import import_revision
from benchlib.stats import compare, op_summary, pass_cpu, quad_schedule
from benchlib.steps import GcLog, batches, kwargs_of, profile_steps, step, timed_iteration

# ---- the arms -------------------------------------------------------------------------------------------------------


@dataclass
class Arm:
    name: str
    options: dict | None  # ShardIntermediates options; None: no pass
    revision: str | None = None  # a git revision whose pass this arm runs (None: this checkout's)
    bench: object = None  # thunder.benchmarks.benchmark_litgpt.Benchmark_litGPT
    shard: object = None  # the ShardIntermediates instance (with the pass)
    resident_bytes: int = 0  # allocated bytes this arm added while built and warmed up (parameters, optimizer state)
    alone_peak_bytes: int | None = None  # the process's peak while only the arms built so far existed
    before_bytes: int = 0  # allocated bytes when this arm's build began (the arms built before it)
    budget_below_base: int | None = None  # policy "budget": this many bytes under the base's peak (relative_budget)
    which: str = "shard"  # the pass: "shard" (ShardIntermediates) or "compact" (CompactSavedViews: compaction alone)
    build_s: float = 0.0
    first_iteration_s: float = 0.0
    entries: list | None = None  # --one-model: the arm's programs, cache entries of the base's model
    program_s: float | None = None  # --one-model: seconds its programs took (the pass's hooks, the callables)
    replans: int = 0  # --one-model: programs made again after the pass dropped them (a missed budget's replan)
    failed: str | None = None  # --one-model: why the arm's programs could not be made or run (it is left out)
    running: Arm | None = None  # --one-model, the base's: the arm whose programs are the model's cache now
    flags: list[str] | None = None  # the benchmark's flags of a model of its own (None: the run's)
    drawn: list | None = None  # an arm with flags of its own: its batches
    tokens: int = 0  # tokens an iteration, every rank's: micro-batch x sequence x world size
    notes: list[str] = field(default_factory=list)


ARM_KEYS = ("revision", "budget_below_base_bytes", "pass", "flags")  # an arm's keys that are the benchmark's, not the
# pass's; "flags": the arm is a model of its own, built from these flags of Thunder's benchmark (a micro-batch, activation
# checkpointing), compiled with its pass at its first call as a user's (capacity.py times the winners of a memory cap)


def parse_arms(text: str, cuda: bool) -> list[Arm]:
    """``--arms``: name -> options (the pass's, and the benchmark's :data:`ARM_KEYS`) or null, the first the base."""
    arms = [Arm(name, None if opts is None else {k: v for k, v in opts.items() if k not in ARM_KEYS},
                None if opts is None else opts.get("revision"),
                budget_below_base=None if opts is None else opts.get("budget_below_base_bytes"),
                which="shard" if opts is None else opts.get("pass", "shard"), flags=(opts or {}).get("flags"))
            for name, opts in json.loads(text).items()]
    if any(a.which not in ("shard", "compact") or (a.which == "compact" and a.revision) for a in arms):
        raise SystemExit('--arms: "pass" is "shard" (ShardIntermediates) or "compact" (CompactSavedViews, this '
                         'checkout only)')
    if any(a.budget_below_base is not None for a in arms) and not cuda:
        raise SystemExit("--arms: budget_below_base_bytes needs CUDA (the budget is in device bytes)")
    if len(arms) < 2 or arms[0].options is not None:
        raise SystemExit("--arms: the first arm is the base and has no pass (null), and at least one more arm")
    if arms[0].flags or any(a.flags and (a.options is None or a.revision or a.budget_below_base is not None)
                            for a in arms):
        raise SystemExit('--arms: "flags" is for an arm with this checkout\'s pass (the base\'s flags follow "--")')
    return arms


def pass_classes(arms: list[Arm], into: str) -> dict:
    """``(revision, which) -> the pass's class`` for every arm: this checkout's, and another revision's (imported
    under ``into``; at most one other revision a process)."""
    from thunder_fp8shard import CompactSavedViews, ShardIntermediates

    passes = {(None, "shard"): ShardIntermediates, (None, "compact"): CompactSavedViews}
    revs = {a.revision for a in arms if a.revision is not None}
    if len(revs) > 1:
        raise SystemExit(f"--arms: at most one other revision of the pass in a process, got {sorted(revs)}")
    for rev in revs:
        passes[rev, "shard"] = import_revision(rev, into).ShardIntermediates
    return passes


def reserve(torch, device, nbytes: int):
    """``nbytes`` of device memory held (a tensor; None for 0): while an arm is built and compiled, the memory the arms
    built after it will hold (estimated as the resident bytes of the arm built before it: the same model, its
    parameters, gradients' leftovers and optimizer state), so that the pass measures, and plans for, the memory
    the timed iterations will run in, where every arm is resident (``--reserve-later``, on by default). A budget
    arm's budget, and every arm's predicted peak, are then those of the timed iterations."""
    if nbytes <= 0:
        return None
    return torch.empty(int(nbytes), dtype=torch.uint8, device=device)


def relative_budget(resident_now: int, base_peak: int, base_before: int, below: int) -> int:
    """``budget_bytes`` for an arm with ``"budget_below_base_bytes": below``: where the base arm's step peaked
    (``base_peak``, over the ``base_before`` bytes resident when it was built) on top of what is resident now
    (``resident_now``: every arm built so far), less ``below``. That is the device bytes this arm's step would peak
    at without the pass, in this process, minus ``below``: what ``max_memory_allocated`` must stay within."""
    if below < 0 or base_peak < base_before:
        raise ValueError(f"budget_below_base_bytes must be >= 0 and the base built first (got {below}, "
                         f"base peak {base_peak} over {base_before})")
    return resident_now + base_peak - base_before - below


# ---- building the arms ------------------------------------------------------------------------------------------------


def build(bl, arm: Arm, kwargs: dict, passes: dict) -> None:
    """``arm.bench``: Thunder's ``Benchmark_litGPT`` from the flags, with the arm's pass appended while it compiles."""
    arm.shard = passes[arm.revision, arm.which](**arm.options) if arm.options is not None else None
    start = time.perf_counter()
    with pass_appended(bl, arm.shard):
        arm.bench = bl.Benchmark_litGPT(**kwargs)
    # the batches are drawn in this process (see steps.batches): stop the benchmark's DataLoader workers
    arm.bench.train_data_iter = arm.bench.train_dataloader = None
    gc.collect()
    arm.build_s = time.perf_counter() - start
    if arm.shard is not None:
        arm.notes.append(f"the pass is in the model's transforms {_count_pass(arm.bench.model, arm.shard)} time(s)")


def _count_pass(model, shard) -> int | None:
    """How often ``shard`` is among the compiled model's transforms (Thunder's jit; None under ThunderFX, which
    compiles later, per subgraph)."""
    import thunder

    try:
        return list(thunder.compile_data(model).transforms).count(shard)
    except Exception:  # not a ThunderModule (ThunderFX): its subgraphs are compiled at the first call
        return None


def warm_up(torch, arm: Arm, drawn: list, warmup: int, base: Arm | None = None) -> None:
    """The arm's first iteration (it compiles, unless it is a program of the base's model), then ``warmup`` more; on
    CUDA, the steady state's peak (the warm-up iterations': the first backward after an optimizer step, too) and the
    bytes the arm added. ``base`` (``--one-model``): the arm's programs run (:func:`_activate`) before each iteration;
    where its pass replanned, the new programs get ``warmup`` more iterations (their own checks run in them)."""
    dev = arm.bench.device
    cuda = dev.type == "cuda"
    if base is not None:
        _activate(base, arm)
    t = time.perf_counter()
    step(arm.bench, drawn[0])  # compiles
    arm.first_iteration_s = time.perf_counter() - t
    if cuda:
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    k = 0
    while k < warmup:
        if base is not None and _activate(base, arm) and arm.replans <= 3:
            k = 0
            if cuda:
                torch.cuda.synchronize(dev)
                torch.cuda.reset_peak_memory_stats(dev)
        step(arm.bench, drawn[k % len(drawn)])
        k += 1
    if cuda:
        torch.cuda.synchronize(dev)
        arm.alone_peak_bytes = torch.cuda.max_memory_allocated(dev)
        arm.resident_bytes = torch.cuda.memory_allocated(dev) - arm.before_bytes
    made = f" (a program of the base's model, made in {arm.program_s:.1f} s, {arm.replans} replan(s))" if (
        arm.program_s is not None) else ""
    print(f"[paired] built {arm.name}{made}: {arm.build_s:.1f} s, first iteration {arm.first_iteration_s:.1f} s, "
          f"resident {arm.resident_bytes / 1e9:.2f} GB, peak so far {(arm.alone_peak_bytes or 0) / 1e9:.2f} GB",
          flush=True)


def build_arms(torch, bl, arms: list[Arm], kwargs: dict, passes: dict, args, rank: int) -> list:
    """Every arm built and warmed up alone, the arms without the pass first (see the module docstring); with
    ``--reserve-later``, the memory the arms built after each will hold is reserved while it is built (see
    :func:`reserve`). A budget arm's budget is set relative to the base (:func:`relative_budget`). Returns the
    batches."""
    dev = bl.device
    cuda = dev.type == "cuda"
    order = sorted(arms, key=lambda a: a.options is not None)
    if args.one_model:
        return _build_programs(torch, bl, order, kwargs, passes, args, rank)
    drawn, placeholder = None, None
    for j, arm in enumerate(order):
        placeholder = None  # freed: the next reservation is made for the arms after this one
        if cuda and args.reserve_later and j:
            placeholder = reserve(torch, dev, (len(order) - 1 - j) * order[j - 1].resident_bytes)
        arm.before_bytes = torch.cuda.memory_allocated(dev) if cuda else 0
        if arm.budget_below_base is not None:
            base = arms[0]
            arm.options = {**arm.options, "budget_bytes": relative_budget(
                arm.before_bytes, base.alone_peak_bytes, base.before_bytes, arm.budget_below_base)}
        build(bl, arm, kwargs_of(arm.flags) if arm.flags else kwargs, passes)
        arm.drawn = batches(arm.bench, rank) if arm.flags else None
        drawn = drawn or batches(arm.bench, rank)
        warm_up(torch, arm, arm.drawn or drawn, args.warmup)
    del placeholder  # every arm is built: what was reserved for them, they hold
    return drawn


def _build_programs(torch, bl, order: list[Arm], kwargs: dict, passes: dict, args, rank: int) -> list:
    """``--one-model``: the base built and warmed up as without it; every other arm a program of the base's model
    (:mod:`benchlib.shared_compile`), its pass compiled now, with the optimizer's state resident (counted by the
    resident measurement: ``optimizer_states`` 0), then warmed up. Returns the batches."""
    base = order[0]
    build(bl, base, kwargs, passes)
    drawn = batches(base.bench, rank)
    warm_up(torch, base, drawn, args.warmup)
    if not shared_compile.shareable(base.bench.model):
        raise SystemExit("--one-model: the base is not one Thunder-jitted module (ThunderFX compiles each subgraph "
                         "through Dynamo): build each arm on its own")
    base.entries = shared_compile.entries(base.bench.model)
    cuda = bl.device.type == "cuda"
    for arm in order[1:]:
        if arm.flags:  # a model of its own: compiled with its pass at its first call
            arm.before_bytes = torch.cuda.memory_allocated(bl.device) if cuda else 0
            build(bl, arm, kwargs_of(arm.flags), passes)
            arm.drawn = batches(arm.bench, rank)
            warm_up(torch, arm, arm.drawn, args.warmup)
            continue
        arm.bench, arm.before_bytes = base.bench, base.before_bytes
        if arm.options is None:
            arm.entries, arm.program_s = base.entries, 0.0
        else:
            if "optimizer_states" in arm.options:
                arm.notes.append(f"optimizer_states={arm.options['optimizer_states']} given: 0 used (the optimizer's "
                                 "state is resident when the program is made, and measured with the resident memory)")
            arm.options = {**arm.options, "optimizer_states": 0}
            if arm.budget_below_base is not None:
                # the same resident memory as the base's step: its peak less the bytes asked
                arm.options["budget_bytes"] = base.alone_peak_bytes - arm.budget_below_base
            arm.notes.append("a program of the base's model (--one-model): the base's traces before the pass, "
                             "rewritten by this arm's pass")
        try:
            if arm.options is not None:
                arm.shard = passes[arm.revision, arm.which](**arm.options)
                _make_programs(base, arm)
            warm_up(torch, arm, drawn, args.warmup, base)
        except Exception as e:  # one arm's failure leaves the others' comparisons standing
            import traceback

            arm.failed = f"{type(e).__name__}: {e}"
            arm.notes.append(f"failed, left out: {traceback.format_exc()[-2000:]}")
            print(f"[paired] {arm.name} failed and is left out: {arm.failed}", flush=True)
            shared_compile.activate(base.bench.model, base.entries)
            continue
        if cuda:
            arm.resident_bytes = base.resident_bytes
    return drawn


def _make_programs(base: Arm, arm: Arm) -> None:
    arm.entries, seconds = shared_compile.programs(base.bench.model, base.entries, arm.shard)
    arm.program_s = (arm.program_s or 0.0) + seconds


def _activate(base: Arm, arm: Arm) -> bool:
    """``--one-model``: the model's next call runs ``arm``'s programs. The arm that ran last keeps the cache as its
    programs left it (the pass may swap an entry for its steady-state one, or drop them all after a missed budget:
    then they are made again, with the replanned pass, when that arm runs next). True if ``arm``'s were."""
    if arm.bench is not base.bench:  # a model of its own (flags): its cache is its own
        return False
    model = base.bench.model
    last = base.running
    if last is not None:
        now = shared_compile.entries(model)
        last.entries = now if now or last.options is None else None
    replanned = arm.entries is None
    if replanned:
        _make_programs(base, arm)
        arm.replans += 1
        print(f"[paired] {arm.name}: its pass replanned; its programs made again", flush=True)
    shared_compile.activate(model, arm.entries)
    base.running = arm
    return replanned


# ---- the alternation ------------------------------------------------------------------------------------------------


def alternate(torch, arms: list[Arm], drawn: list, gc_log: GcLog, args) -> list[dict]:
    """The arms' iterations in ABBA quads against the base (:func:`benchlib.stats.quad_schedule`): the warm-up quads
    discarded, then the timed ones' records."""
    schedule = quad_schedule(len(arms), args.warmup_quads) + quad_schedule(len(arms), args.timed // 2)
    n_warm = 4 * (len(arms) - 1) * args.warmup_quads
    gc.collect()
    if args.freeze_gc:
        gc.freeze()  # the compiled programs and traces: long-lived, never garbage; both sides alike
    records = []
    t_start = time.perf_counter()
    for i, (quad, position, k) in enumerate(schedule):
        if args.one_model:
            _activate(arms[0], arms[k])  # outside the timed iteration; never a compilation among them
        mine = arms[k].drawn or drawn
        r = timed_iteration(torch, arms[k].bench, mine[i % len(mine)], gc_log)
        if i >= n_warm:
            records.append(dict(r, quad=quad, position=position, arm=k, t_s=time.perf_counter() - t_start))
    return records


def operator_cpu(arms: list[Arm], drawn: list, args) -> dict:
    """``--decompose-iters K``: after the timed iterations, K rounds of one iteration of each arm in turn (the odd
    rounds in reverse order; ``--one-model``: its programs activated before each, as in the timed loop), with the
    operators of :func:`benchlib.op_timer.names` timed in its compiled programs (wrapped before each iteration,
    unwrapped afterwards). Per arm: each operator's calls and CPU ms a step (:func:`benchlib.stats.op_summary`), the
    step's CPU ms, and how many operator names its programs have wrapped (0: none found, e.g. under ThunderFX)."""
    from benchlib import op_timer

    timer = op_timer.OpTimer(op_timer.names())
    its, cpu, wrapped = ({a.name: [] for a in arms} for _ in range(3))
    floor = op_timer.floor_ns()
    try:
        for i in range(args.decompose_iters):
            for arm in arms if i % 2 == 0 else arms[::-1]:
                if args.one_model:
                    _activate(arms[0], arm)
                wrapped[arm.name].append(timer.install(op_timer.programs(arm.bench.model)))
                timer.take()
                c0 = time.process_time()
                step(arm.bench, (arm.drawn or drawn)[i % len(drawn)])
                cpu[arm.name].append((time.process_time() - c0) * 1e3)
                its[arm.name].append(timer.take())
    finally:
        timer.uninstall()
    return {"iterations": args.decompose_iters, "timer_floor_ns_per_call": floor,
            "arms": {a.name: {"operators": op_summary(its[a.name]), "step_cpu_ms": float(np.mean(cpu[a.name])),
                              "names_wrapped": max(wrapped[a.name])} for a in arms}}


def python_profile(arms: list[Arm], drawn: list, args, top: int = 400) -> dict:
    """``--cprofile K``: K rounds of one iteration of each arm in turn under ``cProfile`` (one profiler an arm,
    enabled around its iterations alone), after everything else. Per arm: the ``top`` functions by own time, each
    ``[calls, own ms, cumulative ms]`` a step, keyed ``file:line(function)``; Python-level, so Thunder's generated
    programs, the pass's operators and every torch call made from Python each have a row (``time_cpu.py cprofile``
    compares two arms)."""
    import cProfile
    import pstats

    profs = {a.name: cProfile.Profile() for a in arms}
    for i in range(args.cprofile):
        for arm in arms if i % 2 == 0 else arms[::-1]:
            if args.one_model:
                _activate(arms[0], arm)
            profs[arm.name].enable()
            step(arm.bench, (arm.drawn or drawn)[i % len(drawn)])
            profs[arm.name].disable()
    out = {}
    for name, prof in profs.items():
        stats = pstats.Stats(prof).stats
        rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
        out[name] = {f"{os.path.basename(f)}:{line}({fn})": [nc / args.cprofile, tt * 1e3 / args.cprofile,
                                                              ct * 1e3 / args.cprofile]
                     for (f, line, fn), (cc, nc, tt, ct, _) in rows}
    return {"iterations": args.cprofile, "arms": out}


# ---- the results ----------------------------------------------------------------------------------------------------


def describe(args, flags: list[str], arms: list[Arm], records: list[dict], profile, op_cpu, dist,
             world_size: int) -> dict:
    """The fields every comparison of the run shares: the setup, the design, the arms, the records, the profile, the
    operators' CPU (:func:`operator_cpu`)."""
    from benchlib import collectives

    if args.simulate:
        communication = "none (simulated ranks: torch's fake process group" + (
            "; every collective one kernel on the current stream, --sim-collectives one-kernel)"
            if args.sim_collectives == "one-kernel" else
            "; its own collectives, --sim-collectives fake-group: N copies an all-gather, nothing for the others)") + (
            "; the pass's all-gathers keep NCCL's stream protocol (--comm-stream): their copies on a side stream"
            if args.comm_stream else "; the all-gathers' copies run on the compute stream")
    else:
        communication = f"{dist.get_backend() if dist.is_initialized() else 'none'}, {world_size} ranks"
    return {
        "kind": "paired", "simulated": bool(args.simulate), "world_size": world_size, "communication": communication,
        "sim_collectives": args.sim_collectives if args.simulate else None,
        "sim_collective_calls": dict(collectives.calls) if args.simulate and args.sim_collectives == "one-kernel"
        else None,
        "n_layers": int(flag(flags, "n_layers", 0)) or None, "low_precision_mode": flag(flags, "low_precision_mode", "none"),
        "model_name": flag(flags, "model_name"), "flags": flags, "device": device_name(),
        "launch": " ".join([os.path.basename(sys.executable), *sys.argv]), "started": args.started,
        "design": f"ABBA quads against the base arm, {args.timed} timed iterations per arm ({args.timed // 2} quads), "
                  f"{args.warmup_quads} warm-up quads per arm discarded, bootstrap 95% CI over quads; "
                  f"gc.freeze after warm-up: {args.freeze_gc}; "
                  + ("one model, one compilation, every arm a program of it (--one-model)" if args.one_model else
                     "every arm a model of its own, compiled on its own"),
        "arms": [{"name": a.name, "options": a.options, "revision": a.revision, "flags": a.flags,
                  "tokens_per_iteration": a.tokens, "build_s": a.build_s, "program_s": a.program_s, "replans": a.replans, "first_iteration_s": a.first_iteration_s,
                  "resident_GB": a.resident_bytes / 1e9,
                  "alone_peak_GB": None if a.alone_peak_bytes is None else a.alone_peak_bytes / 1e9,
                  "notes": a.notes, "plan": plan_summary(a.shard)} for a in arms],
        "records": records, "profile": profile, "op_cpu": op_cpu,
    }


def tokens_per_s(overhead: dict, base_tokens: int, tokens: int) -> dict:
    """Both sides' tokens a second (every rank's tokens an iteration over the median iteration) and the arm's over the
    base's, with the CI of its time's overhead carried over (the ratio falls as the time rises)."""
    if not (base_tokens and tokens):
        return {}
    ms = overhead["base_median"]
    ratio = lambda pct: tokens / base_tokens / (1 + pct / 100)  # noqa: E731
    return {"tokens_per_s": {"base": base_tokens / ms * 1e3, "arm": tokens / (ms * (1 + overhead["median"] / 100)) * 1e3},
            "tokens_per_s_ratio": {"median": ratio(overhead["median"]),
                                   "ci95": [ratio(overhead["ci95"][1]), ratio(overhead["ci95"][0])]}}


def comparison(common: dict, arms: list[Arm], k: int, records: list[dict]) -> dict:
    """Arm ``k`` against the base: the overheads (:func:`benchlib.stats.compare`) and, with the pass, its plan's
    ideal saving, predicted and measured peaks, and (a budget arm) whether every timed iteration met the budget."""
    arm = arms[k]
    res = dict(common, arm=arm.name, base=arms[0].name, options=arm.options, revision=arm.revision,
               null=arm.options is None, **compare(records, k))
    res.update(tokens_per_s(res["overhead_pct"], arms[0].tokens, arm.tokens))
    ops = (common["op_cpu"] or {}).get("arms", {})
    if all(ops.get(a.name, {}).get("names_wrapped") for a in (arms[0], arm)):  # a null arm's: the A/A check
        res["pass_cpu"] = pass_cpu(ops[arms[0].name]["operators"], ops[arm.name]["operators"],
                                   common["op_cpu"]["iterations"])
        res["pass_cpu_ms_per_step"] = res["pass_cpu"]["net_ms_per_step"]
    plan = plan_summary(arm.shard)
    if not plan:
        return res
    # (k-1)/k of the sharded copies (the shard group's k), and what the compactions free
    sharding = plan["saving_fraction"] * plan["sharded_bytes"] / 1e9
    ideal = sharding + plan["compaction_freed_bytes"] / 1e9
    res["ideal_sharding_reduction_GB"], res["compaction_freed_GB"] = sharding, plan["compaction_freed_bytes"] / 1e9
    res["compacted_bytes"] = plan["compacted_bytes"]
    res["ideal_reduction_GB"] = ideal
    res["reduction_share_of_ideal"] = res["memory_reduction_GB"] / ideal if ideal else None
    res["predicted_peak_GB"] = {"before": plan["peak_bytes_before"] / 1e9, "after": plan["peak_bytes_after"] / 1e9}
    res["measured_peak_GB"] = {
        "base": float(np.median([r["peak_bytes"] for r in records if r["arm"] == 0])) / 1e9,
        "arm": float(np.median([r["peak_bytes"] for r in records if r["arm"] == k])) / 1e9}
    res["gathered_bytes_per_step"] = plan.get("gathered_bytes_per_step")
    before, after = plan.get("forward_gather_bytes_per_step") or (0, 0)
    if before:  # fp8_forward_gather: the forward's weight all-gathers, in bf16 (the base's) and as the arm gathers them
        res["forward_gather_bytes_per_step"] = {"base": before, "arm": after}
        cast = plan.get("forward_cast_elements_per_step") or (0, 0)
        res["forward_cast_elements_per_step"] = {"base": cast[0], "arm": cast[1]}
    if arm.budget_below_base is not None:
        worst = max(r["peak_bytes"] for r in records if r["arm"] == k)
        res["budget"] = {"below_base_bytes": arm.budget_below_base, "budget_bytes": arm.options["budget_bytes"],
                         "largest_iteration_peak_bytes": worst, "met": worst <= arm.options["budget_bytes"]}
    return res


# ---- the run --------------------------------------------------------------------------------------------------------


def harness(args):
    """Thunder's benchmark module (``bl``), imported under the run's patches (simulated ranks, the CPU, the pass's
    gathers on a side stream), with torch and torch.distributed."""
    if args.simulate:
        simulate(args.simulate, args.sim_collectives)
    if args.device == "cpu":
        on_the_cpu()
    import torch
    import torch.distributed as dist
    import thunder.benchmarks.benchmark_litgpt as bl

    if args.comm_stream:
        pass_gathers_on_their_own_stream()
    if args.device == "cpu":
        bl.device = torch.device("cpu")
    torch.set_float32_matmul_precision("high")  # as the benchmark's __main__
    return torch, dist, bl


@contextlib.contextmanager
def exclusive(path: str | None, busy: str | None):
    """``--gpu-lock``: several runs of one sitting compile side by side on one GPU, but time alone. This run's
    ``--busy`` file (one a job of the sitting, made by the sitting's script before it starts the jobs) is removed
    now that its arms are built; the timed iterations then wait until no job is still building (its folder is empty:
    no other compilation beside them) and hold an exclusive lock on ``path`` (no other timed iterations beside
    them): a shared GPU is no evidence of speed."""
    if not path:
        yield
        return
    t = time.perf_counter()
    if busy:
        with contextlib.suppress(FileNotFoundError):
            os.remove(busy)
        while os.listdir(os.path.dirname(busy)) and time.perf_counter() - t < 1800:
            time.sleep(2)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        print(f"[paired] the GPU to itself after {time.perf_counter() - t:.1f} s "
              f"(still building: {os.listdir(os.path.dirname(busy)) if busy else 'not tracked'})", flush=True)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run(args, flags: list[str]) -> list[dict]:
    """Builds the arms, alternates their iterations, and returns one result a comparison (rank 0; others: [])."""
    torch, dist, bl = harness(args)
    kwargs = kwargs_of(flags)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    arms = parse_arms(args.arms, bl.device.type == "cuda")
    revisions = tempfile.TemporaryDirectory()  # lives as long as this run
    passes = pass_classes(arms, revisions.name)
    gc_log = GcLog()
    gc.callbacks.append(gc_log)
    drawn = build_arms(torch, bl, arms, kwargs, passes, args, rank)
    failed = [a for a in arms if a.failed]
    arms = [a for a in arms if not a.failed]
    for a in arms:
        a.tokens = a.bench.micro_batch_size * a.bench.config.block_size * world_size
    if args.gpu_lock and bl.device.type == "cuda":  # built: give back what the warm-ups reserved while others build
        torch.cuda.empty_cache()
    with exclusive(args.gpu_lock, args.busy):
        records = alternate(torch, arms, drawn, gc_log, args)
        op_cpu = operator_cpu(arms, drawn, args) if args.decompose_iters > 0 else None
        if args.cprofile > 0:
            op_cpu = dict(op_cpu or {}, cprofile=python_profile(arms, drawn, args))
        profile = None
        if args.profile:
            before = {a.name: (lambda a=a: _activate(arms[0], a)) for a in arms} if args.one_model else None
            profile = profile_steps(torch, {a.name: a.bench for a in arms if _profiled(a, args)}, drawn[0],
                                    args.trace_dir, before=before)
    gc.callbacks.remove(gc_log)
    if rank != 0:
        return []
    common = describe(args, flags, arms, records, profile, op_cpu, dist, world_size)
    common["failed_arms"] = [{"name": a.name, "options": a.options, "failed": a.failed, "notes": a.notes}
                             for a in failed]
    return [comparison(common, arms, k, records) for k in range(1, len(arms))]


def _profiled(arm: Arm, args) -> bool:
    return not args.profile_arms or arm.name in args.profile_arms.split(",")


def write(results: list[dict], out: str) -> None:
    """``<out>_<arm>.json`` a comparison, and ``<out>_accuracy_<arm>.json`` a plan-accuracy report."""
    for r in results:
        path = f"{out}_{r['arm']}.json"
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(r, f, indent=1)
        print(f"[paired] wrote {path}")
    for name, report in accuracy_reports(results).items():
        path = f"{out}_accuracy_{name}.json"
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        print(f"[paired] wrote {path}: predicted {report['predicted_peak_bytes'] / 1e9:.3f} GB, measured "
              f"{report['measured_peak_bytes'] / 1e9:.3f} GB ({report['error_pct']:+.2f}%)")


def main(argv: list[str] | None = None) -> None:
    own, flags = split_argv(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arms", default='{"without": null, "with": {}}',
                   help="JSON object: arm name -> ShardIntermediates options, or null for no pass; the first is the base")
    p.add_argument("--simulate", type=int, default=0, metavar="N", help="rank 0 of N in torch's fake process group")
    p.add_argument("--sim-collectives", choices=("one-kernel", "fake-group"), default="one-kernel",
                   help="with --simulate: one-kernel (default), every collective of the step one kernel on the current "
                        "stream, as NCCL launches one (benchlib/collectives.py); fake-group, the fake group's own (an "
                        "all-gather N copies, an all-reduce or reduce-scatter nothing)")
    p.add_argument("--decompose-iters", type=int, default=5, metavar="K",
                   help="after the timed iterations, K rounds of one iteration of each arm with the pass's operators "
                        "and Thunder's it replaces timed in the compiled programs: the JSON's op_cpu, pass_cpu and "
                        "pass_cpu_ms_per_step (benchlib/op_timer.py; 0: none)")
    p.add_argument("--cprofile", type=int, default=0, metavar="K",
                   help="last, K rounds of one iteration of each arm under cProfile: the JSON's op_cpu.cprofile, "
                        "each arm's functions by own time a step (benchmarks/time_cpu.py cprofile compares two arms)")
    p.add_argument("--comm-stream", action="store_true",
                   help="with --simulate on CUDA: the pass's all-gathers run as ProcessGroupNCCL runs them, on a "
                        "stream of their own (otherwise the simulated all-gather writes on the compute stream)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: Thunder's benchmark on the CPU (small configs; the pass's CPU cost in a whole step)")
    p.add_argument("--timed", type=int, default=100, help="timed iterations per arm (even)")
    p.add_argument("--warmup", type=int, default=2, help="iterations of each arm right after it is compiled")
    p.add_argument("--no-reserve-later", dest="reserve_later", action="store_false",
                   help="do not reserve, while an arm is built, the memory of the arms built after it (see reserve)")
    p.add_argument("--warmup-quads", type=int, default=2, help="alternating quads per arm before timing (discarded)")
    p.add_argument("--no-freeze-gc", dest="freeze_gc", action="store_false",
                   help="do not gc.freeze() the objects alive after warm-up")
    p.add_argument("--one-model", action="store_true",
                   help="one model, compiled once: every arm after the base is a program of it, the base's traces "
                        "before the pass rewritten by the arm's pass (benchlib/shared_compile.py; Thunder's jit only)")
    p.add_argument("--profile", action="store_true", help="afterwards, profile one iteration of each arm")
    p.add_argument("--profile-arms", default=None, help="with --profile: the arms to profile (comma-separated; "
                   "default: all)")
    p.add_argument("--trace-dir", default=None, help="with --profile: where the gzipped Chrome traces go")
    p.add_argument("--gpu-lock", default=None, metavar="PATH",
                   help="hold an exclusive lock on PATH while timing (runs of one sitting compile side by side, "
                        "never time side by side)")
    p.add_argument("--busy", default=None, metavar="FILE",
                   help="with --gpu-lock: this job's file in the sitting's folder of jobs still building, removed "
                        "when its arms are built; the timing waits until that folder is empty")
    p.add_argument("--out", help="JSON path prefix: one <out>_<arm>.json per comparison")
    args = p.parse_args(own)
    json.loads(args.arms)
    if args.comm_stream and not (args.simulate and args.device == "cuda"):
        p.error("--comm-stream is for simulated ranks on CUDA (--simulate N): NCCL keeps its own stream")
    if args.profile and any("flags" in (o or {}) for o in json.loads(args.arms).values()):
        p.error("--profile runs one batch on every arm: not with an arm of flags of its own (another batch shape)")
    if args.comm_stream and any("revision" in (o or {}) for o in json.loads(args.arms).values()):
        p.error("--comm-stream patches this checkout's operators only: a \"revision\" arm would keep its gathers on "
                "the compute stream")
    args.started = time.strftime("%Y-%m-%d %H:%M:%S")
    sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]
    results = run(args, flags)
    if results and args.out:
        write(results, args.out)
    if results:
        print(results_table(results), flush=True)


if __name__ == "__main__":
    main()
