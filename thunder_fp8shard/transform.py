"""``ShardIntermediates``: the Thunder transform, the pass's I/O with Thunder; the stages run in
:func:`thunder_fp8shard.pipeline.compile_plan`.

Thunder calls the post-optimization hook on the forward, then the backward trace of each cache entry. What to shard
is decided on the joint program, so the forward hook returns a stand-in trace and the backward hook plans, rewrites
and fills the stand-in in place (Thunder builds the forward callable only after both hooks ran). Hence this must be
the last transform with a post-optimization hook, which is checked.
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
    stand_in: TraceCtx  # what Thunder holds; the backward hook fills it
    seconds: float
    device: DeviceMemory | None  # None on the CPU
    setup: integrations.Integration | None  # None: compaction alone
    shards: ShardGroup | None
    stats: object = None  # Thunder's compile stats (its cache)
    te_names: frozenset[str] = frozenset()


class ShardIntermediates(Transform):
    """Shards saved-for-backward tensors that are identical on every rank (Thunder FSDP or DDP, PyTorch
    FSDP2 under ThunderFX) and all-gathers them back just before their backward consumers. Gradients are bitwise
    identical to the run without the pass.

    Use as the last transform: ``thunder.jit(model, transforms=[FSDPTransform(...), ShardIntermediates()])``, or in
    ThunderFX's transforms: ``torch.compile(model, backend=ThunderCompiler(transforms=[ShardIntermediates()]))``.
    ``plans`` holds one :class:`~thunder_fp8shard.plan.ShardPlan` per compiled cache entry, newest last;
    ``reports[i]`` is what the run-time checks observed of ``plans[i]``. :meth:`describe` renders both, :meth:`plot`
    draws the predicted memory timelines.

    Options: keyword-only, the fields of :class:`~thunder_fp8shard.options.ShardOptions` with its defaults, validated
    at construction; docs/options.md says what each does. :meth:`inject` replaces what the pass reads of
    the world.
    """

    def __init__(self, **options):
        self.options = options_from(type(self).__name__, options, type(self).OPTIONS)
        self.plans: list[ShardPlan] = []
        self.reports: list[RunReport] = []  # one per plan, same order
        self._pending: _PendingForward | None = None
        self._groups = ShardGroups(self.options.comm, self.options.shard_group_size)
        self._calibration_bytes: int | None = None  # set by a missed budget
        self.seams = Seams()
        self._layouts = Layouts()  # open while the ranks compile together
        self._clock = StepClock()  # its first backward closes the layouts
        self._clock.on_backward = self._close
        self._replanned = False  # a missed budget keeps the layouts open until a program compiles

    def _close(self) -> None:
        if not self._replanned:
            self._layouts.open = False

    def __deepcopy__(self, memo) -> ShardIntermediates:
        """The transform itself: it holds process groups, which cannot be copied. Lightning's ``torch.compile``
        wrapper deep-copies the compile arguments, transforms among them."""
        return self

    def inject(self, **seams) -> ShardIntermediates:
        """Replaces fields of :class:`~thunder_fp8shard.pipeline.Seams`. Returns the transform."""
        self.seams = dataclasses.replace(self.seams, **seams)
        return self

    def describe(self, index: int = -1) -> str:
        """The plan of compilation ``index`` in words, with what its run-time checks found."""
        return plan_text(self.plans[index], self.reports[index])

    def plot(self, path=None, index: int = -1):
        """The predicted memory timeline of compilation ``index``, before and after (a matplotlib Figure;
        ``path`` saves a PNG)."""
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
        # on every compilation: creating groups is collective, every rank must do it alike
        return setup, self._groups.for_setup(setup.group, setup.ranks, setup.name)

    def _forward(self, fw: TraceCtx) -> TraceCtx:
        start = time.perf_counter()
        self._pending = None
        transforms = list(getattr(get_compile_data(), "transforms", None) or [])
        later = transforms[transforms.index(self) + 1 :] if self in transforms else []
        hooked = [t for t in later
                  if type(t).transform_trace_post_optimization is not Transform.transform_trace_post_optimization]
        if hooked:  # this must be the last transform with a post-optimization hook
            raise RuntimeError(
                f"{type(self).__name__} must be the last transform with a post-optimization step (it completes the "
                f"forward trace when it sees the backward); move it after {', '.join(type(t).__name__ for t in hooked)}"
            )
        setup, shards = self._setup()
        if not forward_saved(fw)[0]:
            header = plan_header(self.options, setup, shards)
            note = "forward-only compile (no_grad or no input requires grad): nothing is saved for backward"
            self._record(ShardPlan(**{**header, "notes": (*header["notes"], note)}), RunReport())
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
                           type(self).__name__, self.seams, self._layouts, self._clock, start - pending.seconds)
        self._replanned = False
        pending.stand_in.bound_symbols = out.forward.bound_symbols
        pending.stand_in.set_provenance(out.forward.get_provenance())
        out.calibration.on_done = checks_dropper(pending.stats, pending.stand_in, out.backward)
        self._record(out.plan, out.report)
        return out.backward

    def _replan(self, compile_stats, error_bytes: int) -> None:
        """After a missed budget (on every rank alike): plan with the error as a measured term, and make the
        next call compile again."""
        self._calibration_bytes = max(self._calibration_bytes or 0, 0) + max(error_bytes, 0)
        cache_dropper(compile_stats)()
        self._layouts.open, self._replanned = True, True  # every rank compiles at its next call
        self._clock.reset()

    def _record(self, plan: ShardPlan, report: RunReport) -> None:
        self.plans.append(plan)
        self.reports.append(report)
        if log.isEnabledFor(logging.INFO):
            log.info("%s", plan_text(plan))


class CompactSavedViews(ShardIntermediates):
    """Compaction of saved views alone, without any distributed setup (one GPU, any Thunder program): each
    saved view keeping a larger storage alive is replaced by a compact copy where that frees more than it copies
    (:mod:`thunder_fp8shard.analysis.compaction`). Gradients are bitwise unchanged. Use it as the last transform;
    ``ShardIntermediates`` compacts too (``compact="auto"``): use one of the two. Its options are those of
    :attr:`OPTIONS`, as for ``ShardIntermediates``.
    """

    OPTIONS = ("min_bytes", "policy", "budget_bytes", "resident_bytes", "optimizer_states", "loss_bytes")

    def __init__(self, **options):
        super().__init__(**options)

    __init__.__signature__ = signature(OPTIONS)

    def _setup(self) -> tuple[None, None]:
        return None, None
