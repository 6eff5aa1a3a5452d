"""The memory a training step runs in besides the program's own tensors: terms on the joint timeline, each measured,
modelled or given: resident at the call (allocated at compilation, less the program's inputs), inputs and outputs held
by the caller, the loss (2 x the forward's floating-point outputs), optimizer state (``optimizer_states`` x the
gradients; unknown by default, since the optimizer is the caller's and creates it after the first compilation),
persistent workspaces (:mod:`thunder_fp8shard.memory.device`) and the sdpa backward's fp32 accumulator. The ranks agree
each term's largest value before planning."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from thunder.core import dtypes
from thunder.core.prims import PrimIDs
from thunder.core.proxies import TensorProxy
from thunder.core.trace import TraceCtx

from thunder_fp8shard.analysis.liveness import Life
from thunder_fp8shard.plan import GIVEN, MEASURED, MODELLED, NOT_COUNTED, UNKNOWN, MemoryTerm
from thunder_fp8shard.format import fmt_bytes
from thunder_fp8shard.analysis.saved import numel, tensor_nbytes

if TYPE_CHECKING:  # pragma: no cover
    from thunder_fp8shard.analysis.program import ProgramFacts
    from thunder_fp8shard.memory.device import DeviceMemory
    from thunder_fp8shard.options import ShardOptions

# symbols whose kernel keeps an fp32 accumulator the shape of their first tensor argument (the output gradient)
SDPA_BACKWARD = (
    "sdpaex_scaled_dot_product_efficient_attention_backward",
    "sdpafx_scaled_dot_product_efficient_attention_backward",
    "cudnn_sdpa_bwd",
)
LOSS_COPIES = 2  # the loss rule: copies of the forward's floating-point outputs
RESIDENT, OPTIMIZER = "resident at the call", "optimizer state"  # the terms' names (the calibration reads them)


def step_terms(facts: ProgramFacts, options: ShardOptions, device: DeviceMemory | None) -> list[MemoryTerm]:
    """The step's terms besides the program ``facts`` describes; ``device``: what was read while compiling (None on the
    CPU)."""
    bw_start, last, life_of = facts.backward_start, facts.last_step, facts.life_of
    inputs, outputs = list(facts.inputs), list(facts.outputs)
    input_storages = {life_of[p.name].name for p in inputs if p.name in life_of}
    grads = _returned_gradients(facts.backward)
    return [
        resident_at_call(inputs, device, options.resident_bytes, last),
        held_by_caller("inputs held by the caller", inputs, life_of, last,
                       "the forward's tensor inputs (parameter shards, the batch) after the program's last use, to "
                       "the end of the backward"),
        held_by_caller("outputs held by the caller",
                       [p for p in outputs if p.name in life_of and life_of[p.name].name not in input_storages],
                       life_of, last, "the forward's outputs from the end of the forward to the end of the backward"),
        loss(outputs, options.loss_bytes, bw_start),
        optimizer_state(grads, options.optimizer_states, last),
        persistent_workspaces(device, last),
        kernel_workspaces(facts.backward, bw_start),
        # last: the only terms whose number can differ between ranks; empty, so the agreement pads every rank's list
        # after them
        *workspaces_not_forced(device),
    ]


def term_lives(terms: list[MemoryTerm]) -> dict[str, Life]:
    """The terms as storage lives (``"term:<name>:<k>"``, one per span), to be added to the program's."""
    return {f"term:{t.name}:{k}": Life(f"term:{t.name}:{k}", (), nbytes, start, end)
            for t in terms for k, (start, end, nbytes) in enumerate(t.spans) if nbytes}


def resident_at_call(inputs: list[TensorProxy], device: DeviceMemory | None, given: int | None, last: int) -> MemoryTerm:
    name = RESIDENT
    if given is not None:
        return MemoryTerm(name, GIVEN, "resident_bytes", ((0, last, given),))
    if device is None:
        return MemoryTerm(name, NOT_COUNTED, "not measured: no CUDA device among the program's inputs (CPU)")
    own = sum(tensor_nbytes(p) for p in inputs if p.device.device_str() == device.device)
    nbytes = max(device.allocated_bytes - own, 0)
    return MemoryTerm(name, MEASURED, f"allocated on {device.device} at compilation ({device.allocated_bytes:,} B) "
                      f"less the program's inputs there ({own:,} B)", ((0, last, nbytes),))


def held_by_caller(name: str, proxies: list[TensorProxy], life_of: Mapping[str, Life], last: int, how: str) -> MemoryTerm:
    """Each storage among ``proxies`` from the step after its program life ends to ``last``."""
    storages = {life_of[p.name].name: life_of[p.name] for p in proxies if p.name in life_of}
    spans = tuple((life.end + 1, last, life.nbytes) for life in storages.values() if life.end < last and life.nbytes)
    return MemoryTerm(name, MODELLED, how, spans)


def loss(outputs: list[TensorProxy], given: int | None, bw_start: int) -> MemoryTerm:
    if given is not None:
        return MemoryTerm("loss", GIVEN, "loss_bytes, at the first backward step", ((bw_start, bw_start, given),))
    floating = sum(tensor_nbytes(p) for p in outputs if dtypes.is_float_dtype(p.dtype))
    return MemoryTerm("loss", MODELLED, f"{LOSS_COPIES} x the forward's floating-point outputs (cross-entropy), at "
                      "the first backward step", ((bw_start, bw_start, LOSS_COPIES * floating),))


def optimizer_state(grads: list[TensorProxy], states: int | None, last: int) -> MemoryTerm:
    name = OPTIMIZER
    grad_bytes = sum(tensor_nbytes(g) for g in grads)
    if states is None:
        return MemoryTerm(name, UNKNOWN, "unknown: pass optimizer_states (Adam, AdamW: 2, which would add 2 x the "
                          f"gradients the backward returns = {fmt_bytes(2 * grad_bytes)}; SGD with momentum: 1; none, "
                          "or already in resident_bytes or the resident measurement: 0)")
    if not states:
        return MemoryTerm(name, GIVEN, "optimizer_states=0: none, or held in the resident bytes")
    return MemoryTerm(name, MODELLED, f"{states} x the gradients the backward returns",
                      ((0, last, states * grad_bytes),))


def persistent_workspaces(device: DeviceMemory | None, last: int) -> MemoryTerm:
    name = "persistent workspaces"
    if device is None:
        return MemoryTerm(name, NOT_COUNTED, "CPU: none")
    nbytes = sum(b for _, b in device.workspaces)
    kinds = ", ".join(f"{kind} {b:,} B" for kind, b in device.workspaces) or "none"
    return MemoryTerm(name, MEASURED, f"allocated when forced at compilation: {kinds}", ((0, last, nbytes),))


def workspaces_not_forced(device: DeviceMemory | None) -> list[MemoryTerm]:
    """One unknown term per workspace the pass could not force: it exists at run time but is not in the predicted
    peak."""
    if device is None:
        return []
    return [MemoryTerm(f"{kind} workspace", UNKNOWN, f"could not be forced at compilation ({why})")
            for kind, why in device.not_forced]


def kernel_workspaces(bw: TraceCtx, bw_start: int) -> MemoryTerm:
    spans = [(bw_start + j, bw_start + j, 4 * numel(next(p for p in b.flat_proxy_args if isinstance(p, TensorProxy))))
             for j, b in enumerate(bw.bound_symbols) if b.sym.name in SDPA_BACKWARD]
    return MemoryTerm("kernel workspaces", MODELLED, "sdpa backward: an fp32 accumulator of its output gradient's "
                      f"shape ({len(spans)} call(s))", tuple(spans))


def _returned_gradients(bw: TraceCtx) -> list[TensorProxy]:
    """The tensors the backward returns, each once."""
    if not bw.bound_symbols or bw.bound_symbols[-1].sym.id != PrimIDs.RETURN:
        return []
    return list({p.name: p for p in bw.bound_symbols[-1].flat_proxy_args if isinstance(p, TensorProxy)}.values())
