"""``ShardIntermediates``: the Thunder transform, the pass's I/O with Thunder (the stages themselves:
:func:`thunder_fp8shard.pipeline.compile_plan`).

Thunder calls the post-optimization hook on the forward trace, then on the backward trace, of each compiled cache
entry. What to shard is decided on the joint program, so the forward hook returns a stand-in trace and the
backward hook has both traces planned and rewritten (``compile_plan``), and fills the stand-in in place (Thunder builds the forward callable
from it only after both hooks ran). Hence ShardIntermediates must be the last transform with a post-optimization
hook; this is checked. Before planning, the inputs that can differ between ranks are agreed across the shard group
(the ranks that run the plan's collectives together), and the plan's collectives are compared across it before the
rewrite (see :mod:`thunder_fp8shard.distributed.agreement`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

from thunder.core.compile_data import _compile_data, get_compile_data
from thunder.core.trace import TraceCtx, TraceProvenance, TraceTag, from_trace
from thunder.core.transform_common import Transform

from thunder_fp8shard.analysis.candidates import te_quantized_names
from thunder_fp8shard.analysis.saved import forward_saved
from thunder_fp8shard.distributed import integrations
from thunder_fp8shard.distributed.layout import Layouts
from thunder_fp8shard.distributed.shard_groups import ShardGroup, ShardGroups
from thunder_fp8shard.memory.device import DeviceMemory, cublas_gemms
from thunder_fp8shard.options import OPTION_NAMES, options_from, signature
from thunder_fp8shard.pipeline import Seams, compile_plan, plan_header
from thunder_fp8shard.plan import ShardPlan
from thunder_fp8shard.reporting.plan_text import plan_text
from thunder_fp8shard.runtime.audit import StepClock, cache_dropper
from thunder_fp8shard.runtime.run_report import RunReport
from thunder_fp8shard.runtime.steady_state import checks_dropper

log = logging.getLogger(__name__)


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
    te_names: frozenset[str] = frozenset()  # the forward's TransformerEngine quantized tensors


class ShardIntermediates(Transform):
    """Shards saved-for-backward tensors that are identical on every rank (Thunder FSDP or DDP, PyTorch FSDP2 under
    ThunderFX, see :mod:`thunder_fp8shard.distributed.integrations`) and all-gathers them back just before their backward
    consumers. Gradients are bitwise identical to the run without the pass.

    Use as the last transform: ``thunder.jit(model, transforms=[FSDPTransform(sharding_strategy=FSDPType.ZERO3),
    ShardIntermediates()])``, or inside ``thunder.distributed.fsdp(...)`` / ``ddp(...)``, or in ThunderFX's
    transforms over an FSDP2 model: ``torch.compile(model, backend=ThunderCompiler(transforms=[ShardIntermediates()]))``.
    Each rank keeps a 1/k shard over its shard group (:mod:`thunder_fp8shard.distributed.shard_groups`): the setup's group, or with
    ``shard_group_size=k`` its run of k consecutive ranks; which tensors are identical is decided over the setup's
    whole group. ``plans`` holds one :class:`~thunder_fp8shard.plan.ShardPlan` per compiled cache entry (under
    ThunderFX, of each subgraph), newest last, fixed at compile time; ``reports[i]`` is what the run-time checks
    observed of ``plans[i]`` (:class:`~thunder_fp8shard.runtime.run_report.RunReport`); :meth:`describe` renders both,
    :meth:`plot` draws the predicted memory timelines.

    Options: keyword-only, the fields of :class:`~thunder_fp8shard.options.ShardOptions` with its defaults
    (``inspect.signature`` and ``help()`` show them), validated at construction; ShardOptions' docstring and the
    README's "Options" table say what each does. What the pass reads of the world (the device, the other ranks) can
    be replaced with :meth:`inject` (tests do, to plant readings on the CPU).
    """

    def __init__(self, **options):
        self.options = options_from(type(self).__name__, options, type(self).OPTIONS)
        self.plans: list[ShardPlan] = []
        self.reports: list[RunReport] = []  # one per plan, same order
        self._pending: _PendingForward | None = None
        self._groups = ShardGroups(self.options.comm, self.options.shard_group_size)  # created once, then reused
        self._calibration_bytes: int | None = None  # set by a missed budget: planned with from then on
        self.seams = Seams()
        self._layouts = Layouts()  # the model's agreed layouts; open while the ranks compile together
        self._clock = StepClock()  # the model's steps: its first backward closes the layouts
        self._clock.on_backward = self._close
        self._replanned = False  # a missed budget dropped every program: the layouts stay open until one compiles

    def _close(self) -> None:
        if not self._replanned:
            self._layouts.open = False

    def __deepcopy__(self, memo) -> ShardIntermediates:
        """The transform itself: it holds process groups (given, or made at its first compilation), which cannot be
        copied, and its plans. Lightning's ``torch.compile`` wrapper deep-copies the compile arguments, a
        ``ThunderCompiler`` with its transforms among them."""
        return self

    def inject(self, **seams) -> ShardIntermediates:
        """Replaces what the pass reads of the world, or a choice a test plants wrong on purpose: the fields of
        :class:`~thunder_fp8shard.pipeline.Seams` (``device_probe``, ``collectives``, ``replication_analysis``,
        ``chooser``). Returns the transform."""
        self.seams = dataclasses.replace(self.seams, **seams)
        return self

    def describe(self, index: int = -1) -> str:
        """The plan of compilation ``index`` (the newest by default) in words, with what its run-time checks found
        once they ran (the audit's and the calibration's lines, the predicted peak as the audit corrected it)."""
        return plan_text(self.plans[index], self.reports[index])

    def plot(self, path=None, index: int = -1):
        """The predicted memory timeline of compilation ``index``, before and after, peaks and gathers marked (a
        matplotlib Figure; ``path`` saves a PNG)."""
        from thunder_fp8shard.reporting.plot import plot_plan

        return plot_plan(self.plans[index], path, self.reports[index])

    OPTIONS = OPTION_NAMES
    __init__.__signature__ = signature(OPTIONS)

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
            plan = plan_header(self.options, setup, shards)
            note = "forward-only compile (no_grad or no input requires grad): nothing is saved for backward"
            self._record(dataclasses.replace(plan, notes=(*plan.notes, note)), RunReport())  # no checks: stays empty
            return fw
        stand_in = from_trace(fw)
        stand_in.bound_symbols = list(fw.bound_symbols)
        stand_in.set_provenance(TraceProvenance(f"{type(self).__name__}: forward as compiled, until its backward is planned"))
        te_names = frozenset(te_quantized_names(fw))
        device = self.seams.device_probe.while_compiling(fw, transformer_engine=bool(te_names), cublas=cublas_gemms(fw))
        stats = _compile_data.get()[1]
        self._pending = _PendingForward(fw, stand_in, time.perf_counter() - start, device, setup, shards, stats,
                                        te_names)
        return stand_in

    def _backward(self, bw: TraceCtx) -> TraceCtx:
        start = time.perf_counter()
        pending, self._pending = self._pending, None
        if pending is None:
            return bw
        out = compile_plan(pending.original, bw, self.options, pending.setup, pending.shards, pending.device,
                           pending.te_names, self._calibration_bytes, functools.partial(self._replan, pending.stats),
                           type(self).__name__, self.seams, self._layouts, self._clock)
        self._replanned = False
        pending.stand_in.bound_symbols = out.forward.bound_symbols
        pending.stand_in.set_provenance(out.forward.get_provenance())
        # once both checks are done, the program's cache entry runs these traces without them
        out.calibration.on_done = checks_dropper(pending.stats, pending.stand_in, out.backward)
        self._record(dataclasses.replace(out.plan, pass_seconds=pending.seconds + time.perf_counter() - start),
                     out.report)
        return out.backward

    def _replan(self, compile_stats, error_bytes: int) -> None:
        """After a missed budget (every rank alike, see :class:`~thunder_fp8shard.runtime.audit.Calibration`): plan every later
        compilation with the error as a measured term, and make the next call compile again."""
        self._calibration_bytes = max(self._calibration_bytes or 0, 0) + max(error_bytes, 0)
        cache_dropper(compile_stats)()
        self._layouts.open, self._replanned = True, True  # every rank compiles at its next call: a layout again
        self._clock.reset()

    def _record(self, plan: ShardPlan, report: RunReport) -> None:
        self.plans.append(plan)
        self.reports.append(report)
        if log.isEnabledFor(logging.INFO):
            log.info("%s", plan_text(plan))


class CompactSavedViews(ShardIntermediates):
    """Compaction of saved views alone, without any distributed setup or sharding (one GPU, any Thunder program): each
    saved view that keeps a larger storage alive is replaced by a compact copy of itself, made right after the
    storage's last forward use, where the copy frees at least as many bytes as it copies (see
    :mod:`thunder_fp8shard.analysis.compaction`; LitGPT's ``v`` under Thunder's benchmark executors). Gradients are bitwise
    those of the run without it. Use it as the last transform: ``thunder.jit(model, transforms=[CompactSavedViews()])``.
    ``ShardIntermediates`` compacts too (``compact="auto"``, its default): use one of the two.

    Options (keyword-only, as for ``ShardIntermediates``): ``min_bytes`` (compactions freeing fewer bytes are left
    out), ``policy`` (``"all"``: every compaction that does not raise the predicted peak; ``"peak"``: those lowering
    it; ``"budget"``: the fewest bytes copied that bring it to ``budget_bytes``), and the memory terms
    ``resident_bytes``, ``optimizer_states``, ``loss_bytes``. ``plans`` holds a
    :class:`~thunder_fp8shard.plan.ShardPlan` per compilation, whose compaction table lists what was compacted and
    why.
    """

    OPTIONS = ("min_bytes", "policy", "budget_bytes", "resident_bytes", "optimizer_states", "loss_bytes")

    def __init__(self, **options):
        super().__init__(**options)

    __init__.__signature__ = signature(OPTIONS)

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
