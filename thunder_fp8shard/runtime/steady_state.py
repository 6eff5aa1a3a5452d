"""The steady state: once the first-call checks are done, the compiled program runs without them.

Both checks return at once after their work, but a CPU-bound step pays for every operator call. So
:func:`checks_dropper` replaces the callables of the program's entry in Thunder's cache by ones built from the same
traces without the checks; those traces are appended to the entry's lists. A backward already connected to autograd
keeps its callable, whose check returns at once. Where the entry is no longer cached, nothing is replaced and the
run report says so.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from thunder.common import transform_to_torch_types
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace

from thunder_fp8shard.runtime import ops

CHECKS = (ops.audit, ops.calibrate)
CHECK_NAMES = tuple(s.name for s in CHECKS)


def without_checks(trace: TraceCtx, provenance: str) -> TraceCtx:
    """A copy of ``trace`` without its first-call checks (nothing reads their outputs)."""
    new = from_trace(trace)
    new.bound_symbols = [b for b in trace.bound_symbols if b.sym not in CHECKS]
    new.set_provenance(TraceProvenance(provenance))
    return new


def checks_dropper(compile_stats, forward: TraceCtx, backward: TraceCtx) -> Callable[[], str | None]:
    """A function that replaces the cache entry of ``forward`` and ``backward`` in ``compile_stats`` (held
    weakly) by one without the checks; it returns what it did, or None where the entry is gone."""
    ref = weakref.ref(compile_stats) if compile_stats is not None else None

    def drop() -> str | None:
        cs = ref() if ref is not None else None
        if cs is None:
            return None
        for i, entry in enumerate(cs.interpreter_cache):
            if entry.computation_traces and entry.computation_traces[-1] is forward and entry.backward_traces and (
                    entry.backward_traces[-1] is backward):
                break
        else:
            return None
        what = f"steady state: the first-call checks {' and '.join(CHECK_NAMES)} removed (done)"
        fw, bw = without_checks(forward, what), without_checks(backward, what)
        cs.interpreter_cache[i] = entry._replace(computation_fn=transform_to_torch_types(fw).python_callable(),
                                                 backward_fn=bw.python_callable())
        entry.computation_traces.append(fw)
        entry.backward_traces.append(bw)
        return "the program's cache entry runs traces without them"

    return drop
