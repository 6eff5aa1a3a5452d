"""The steady state: once the first-call checks (``fp8shard_audit``, ``fp8shard_calibrate``, see
:mod:`thunder_fp8shard.runtime.audit`) have done their work, the compiled program runs without them.

Both checks return at once after their calls, but a training step that is CPU-bound pays for every operator call it
makes. So when the calibration is done (the end of backward call ``CALIBRATION_CALL * runs_per_step``, the audit
having finished at the first backward), :func:`checks_dropper`'s function replaces the callables of the program's
entry in Thunder's cache (``CacheEntry.computation_fn`` and ``backward_fn``) by ones built, as Thunder builds them,
from the same traces without those two bound symbols. The traces the first calls ran stay in the entry's lists, and
the traces without the checks are appended after them (``thunder.last_traces(jm)[-1]`` and
``last_backward_traces(jm)[-1]`` show what runs now, ``[-2]`` what the first calls ran); the run report records
when the checks were removed (``RunReport.checks_removed``). A backward already connected to autograd keeps the callable it
was given (a forward run before the swap); that backward's check returns at once.

The entry is found by its traces' identity; where it is not in the cache (dropped by a replan, ``cache_dropper``, or
a jit without caching), nothing is replaced and the run report says that the checks stay.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from thunder.common import transform_to_torch_types
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace

from thunder_fp8shard.runtime import ops

CHECKS = (ops.audit, ops.calibrate)  # the operators the steady state runs without
CHECK_NAMES = tuple(s.name for s in CHECKS)


def without_checks(trace: TraceCtx, provenance: str) -> TraceCtx:
    """A copy of ``trace`` without its first-call checks (they return nothing and nothing reads them, so nothing else
    changes)."""
    new = from_trace(trace)
    new.bound_symbols = [b for b in trace.bound_symbols if b.sym not in CHECKS]
    new.set_provenance(TraceProvenance(provenance))
    return new


def checks_dropper(compile_stats, forward: TraceCtx, backward: TraceCtx) -> Callable[[], str | None]:
    """A function that replaces, in Thunder's cache of ``compile_stats`` (held weakly), the callables of the entry
    whose last forward and backward traces are ``forward`` and ``backward`` by ones without the first-call checks.
    It returns what it did, in words, or None where the entry is no longer in the cache."""
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
