"""One model, one compilation, every arm a program of it (``paired.py --one-model``).

A 32-layer Llama-2-7b arm takes Thunder about 200 s to compile on the H200 machine, of which the pass's own hooks take
about 2 s: the rest (interpretation, autodiff, fusion, the executors' passes) is the same for every arm, since the
pass is a post-optimization transform, the last of the list. So the base arm (no pass) is built and compiled as
Thunder's benchmark builds it, and every other arm is a cache entry of the same jitted module (:func:`programs`): the
base's final forward and backward traces (what the other transforms' post-optimization hooks returned, exactly what
the pass sees when it compiles with the model) handed to the arm's pass in the model's compile data, and the callables
built from the results as Thunder builds them. Before each of an arm's iterations its entries become the module's
cache (:func:`activate`): the same parameters, optimizer and resident memory for every arm, so that each arm's step
peaks where a run of its own would.

An arm's pass is compiled after the base's warm-up, when the optimizer's state exists: the pass measures it with the
resident memory (``optimizer_states=0`` is then the option that counts it once; ``paired.py`` sets it). A cache entry
without a backward (a forward-only compilation) is kept as it is, without the pass. A ``null`` arm runs the base's own
entries: its A/A check alternates the same program.

Under ThunderFX (FSDP2) every subgraph compiles at the first call through Dynamo, not through one Thunder cache:
there is nothing to share, and :func:`shareable` says no.
"""

from __future__ import annotations

import time


def shareable(model) -> bool:
    """Whether ``model`` is a Thunder-jitted module whose cache :func:`programs` can fill."""
    import thunder

    return thunder.compile_stats(model) is not None and thunder.compile_data(model) is not None


def entries(model) -> list:
    """``model``'s cache entries as they are now (the base's, right after its compilation)."""
    import thunder

    return list(thunder.compile_stats(model).interpreter_cache)


def _copy(trace):
    """A copy of ``trace`` with its own list of bound symbols (a pass may replace entries of the list in place)."""
    from thunder.core.trace import from_trace

    new = from_trace(trace)
    new.bound_symbols = list(trace.bound_symbols)
    if trace.get_provenance() is not None:
        new.set_provenance(trace.get_provenance())
    return new


def programs(model, base: list, shard) -> tuple[list, float]:
    """Cache entries of ``model`` (a ``thunder.jit``-ed module), one for each of ``base`` (its entries without a pass):
    the forward and backward rewritten by ``shard`` (the arm's pass) in the model's compile data, as Thunder's
    ``apply_transforms_and_build_cache_entry`` does after its other post-optimization hooks. Returns them and the
    seconds they took (the pass's hooks and the callables' building)."""
    import thunder
    from thunder.common import transform_to_torch_types
    from thunder.core.compile_data import compile_data_and_stats

    start = time.perf_counter()
    cd, cs = thunder.compile_data(model), thunder.compile_stats(model)
    if not base:
        raise RuntimeError("--one-model: the base arm has no compiled program to share (call it first)")
    out = []
    for e in base:
        if not e.backward_traces:  # forward-only: its trace is already unwrapped, and the pass has nothing to do
            out.append(e)
            continue
        fw, bw = _copy(e.computation_traces[-1]), _copy(e.backward_traces[-1])
        fw_traces, bw_traces = list(e.computation_traces), list(e.backward_traces)
        with compile_data_and_stats(cd, cs):
            new_fw = shard.transform_trace_post_optimization(fw, executors_list=cd.executors_list)
            new_bw = shard.transform_trace_post_optimization(bw, executors_list=cd.executors_list)
            if new_fw is not fw:
                fw_traces.append(new_fw)
            if new_bw is not bw:
                bw_traces.append(new_bw)
            backward_fn = new_bw.python_callable()
            comp = transform_to_torch_types(new_fw).python_callable()
        out.append(e._replace(computation_fn=comp, computation_traces=fw_traces, backward_fn=backward_fn,
                              backward_traces=bw_traces))
    return out, time.perf_counter() - start


def activate(model, arm_entries: list) -> None:
    """``model``'s next calls run ``arm_entries`` (they become its whole cache)."""
    import thunder

    thunder.compile_stats(model).interpreter_cache[:] = arm_entries


def dropped(model) -> bool:
    """Whether ``model``'s cache was emptied by the entries running now (the pass drops it after a missed budget, so
    that the next call replans): the arm's programs must then be made again, or the next call compiles on its own."""
    import thunder

    return not thunder.compile_stats(model).interpreter_cache
