"""The CPU that chosen operators of Thunder's compiled programs take (``paired.py --decompose-iters``), with a cheap
timer (a profiler's cost per operator would distort a figure of about a millisecond).

A compiled program is a Python function whose globals bind each operator's printed name (``fp8shard_gather_start``,
``torch_all_gather_prim_impl``, ...) to its function, fixed when the program was built. :meth:`OpTimer.install`
rebinds those names, in the programs given (a cache entry's forward and backward, under Thunder's decorators), to a
wrapper adding ``time.perf_counter_ns()`` around the call; :meth:`OpTimer.uninstall` binds them back. Self times: a
wrapped operator called inside another counts in the inner one only (the TE linear forward the pass's
``fp8shard_te_linear_fwd`` calls is wrapped too: :data:`CALLED`). :func:`names`: the operators of the pass's
executors and Thunder's it replaces or adds to (:data:`THUNDER_OPS`; the slice is FSDP's unpad and any other).
"""

from __future__ import annotations

import functools
import sys
import time
import types

THUNDER_OPS = ("torch_all_gather_prim_impl", "torch_wait_prim_impl", "torch_reduce_scatter_prim_impl",
               "torch_slice_prim_impl", "te_functional_linear_fwd", "te_functional_linear_bwd",
               "te_fp8_amax_and_scale_update")
PASS_PACKAGES = ("thunder_fp8shard", "thunder_fp8shard_rev")  # this checkout's, another revision's (revisions.py)
# constants of the programs holding an operator's function the pass's operator calls: type name -> (attribute, the
# operator's name); fp8shard_te_linear_fwd calls the TE linear forward it replaced (its spec's ``linear``)
CALLED = {"WeightGatherSpec": ("linear", "te_functional_linear_fwd")}


def names() -> tuple[str, ...]:
    """:data:`THUNDER_OPS` and the operators of the pass's executors in the modules imported (``fp8shard_*``)."""
    import thunder_fp8shard.runtime.fp8_gather_ops  # noqa: F401  (its operators join the executor)
    from thunder.extend import OperatorExecutor

    found = {op for name, m in list(sys.modules.items()) if name.split(".")[0] in PASS_PACKAGES
             and isinstance(getattr(m, "executor", None), OperatorExecutor) for op in m.executor.opmap}
    return (*THUNDER_OPS, *sorted(found))


def programs(model) -> list:
    """The compiled forward and backward of every entry of ``model``'s cache (none: not ``thunder.jit``'s)."""
    import thunder

    cs = thunder.compile_stats(model)
    entries = cs.interpreter_cache if cs is not None else []
    return [f for e in entries for f in (e.computation_fn, e.backward_fn) if f is not None]


def program_globals(fn) -> list[dict]:
    """The globals of the compiled programs (files ``thunder.*``) under ``fn`` and its decorators."""
    out, seen, todo = [], set(), [fn]
    while todo:
        f = todo.pop()
        if not isinstance(f, types.FunctionType) or id(f) in seen:
            continue
        seen.add(id(f))
        if f.__code__.co_filename.startswith("thunder."):
            out.append(f.__globals__)
            continue
        todo.append(getattr(f, "__wrapped__", None))
        for cell in f.__closure__ or ():
            try:
                todo.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
    return out


class OpTimer:
    """Calls and self nanoseconds of the operators ``names``, in the programs it is installed in: wall (``clock``)
    and the thread's CPU time (``cpu_clock``): a call that waits for the device (a full launch queue, a sync) shows
    its wait in the wall figure only where the wait sleeps."""

    def __init__(self, names, clock=time.perf_counter_ns, cpu_clock=time.thread_time_ns):
        self.names, self._clock, self._cpu = frozenset(names), clock, cpu_clock
        self._slots: dict[str, list[int]] = {}  # name -> [calls, wall ns, cpu ns]
        self._inner = [0, 0]  # wall and cpu ns of the wrapped calls inside the current one
        self._wrappers: dict = {}  # (name, id(function)) -> (wrapper, function)
        self._bound: list = []  # (setter, key, function)

    def _wrapper(self, name: str, fn):
        got = self._wrappers.get((name, id(fn)))
        if got is not None:
            return got[0]
        slot, inner, clock, cpu = self._slots.setdefault(name, [0, 0, 0]), self._inner, self._clock, self._cpu

        def timed(*args, **kwargs):
            outer, outer_cpu = inner
            inner[0] = inner[1] = 0
            t0, c0 = clock(), cpu()
            try:
                return fn(*args, **kwargs)
            finally:
                dt, dc = clock() - t0, cpu() - c0
                slot[0] += 1
                slot[1] += dt - inner[0]
                slot[2] += dc - inner[1]
                inner[0], inner[1] = outer + dt, outer_cpu + dc

        timed._op_timer = self
        self._wrappers[name, id(fn)] = (timed, fn)
        return timed

    def install(self, fns) -> int:
        """The operators wrapped in the programs under ``fns`` (and the functions of :data:`CALLED` in their
        constants); returns how many names of theirs are."""
        n = 0
        for fn in fns:
            for g in program_globals(fn):
                sites = [(g.__setitem__, name, g[name], name) for name in self.names.intersection(g)]
                for obj in list(g.values()):
                    attr, name = CALLED.get(type(obj).__name__, (None, None))
                    if name in self.names and callable(getattr(obj, attr, None)):
                        sites.append((functools.partial(setattr, obj), attr, getattr(obj, attr), name))
                for setter, key, fn_, name in sites:
                    if getattr(fn_, "_op_timer", None) is not self:
                        setter(key, self._wrapper(name, fn_))
                        self._bound.append((setter, key, fn_))
                    n += 1
        return n

    def uninstall(self) -> None:
        for setter, key, fn in reversed(self._bound):
            setter(key, fn)
        self._bound.clear()

    def take(self) -> dict[str, tuple[int, int, int]]:
        """``name -> (calls, self wall ns, self cpu ns)`` since the last take (operators called at least once), and a
        new count."""
        out = {name: (s[0], s[1], s[2]) for name, s in self._slots.items() if s[0]}
        for s in self._slots.values():
            s[0] = s[1] = s[2] = 0
        self._inner[0] = self._inner[1] = 0
        return out


def floor_ns(n: int = 20000) -> float:
    """The ns a wrapped empty function records a call: the timer's own share of each call's figure."""
    t = OpTimer(())
    noop = t._wrapper("noop", lambda: None)
    for _ in range(n):
        noop()
    return t.take()["noop"][1] / n
