"""PyTorch FSDP2 (``fully_shard``) under ThunderFX: the replicated roots are the subgraph inputs that are FSDP2's
unsharded parameters; the shards travel on FSDP2's shard group. Dynamo skips FSDP2's hooks, so each ``fully_shard``-ed
module's forward is its own graph, and each part ThunderFX hands to ``thunder.jit`` is planned on its own.

Soundness: FSDP2's pre-forward hook all-gathers each parameter into its ``_unsharded_param``, which the forward reads.
An input is a root only when Dynamo's recorded tensor (``grapharg``) *is* that of a live FSDP2 parameter in the
unsharded state; Dynamo's guards and ``fully_shard``'s own classes keep other layers off the graph. Not covered: one
class and shape sharded over two meshes would share a graph (``verify=True`` detects it). Under HSDP, parameters are
identical across the mesh given identical initial weights, which ``fully_shard`` assumes; a shard group run longer than
FSDP2's relies on that (the plan says so).

Subgraph inputs are never sharded, so gradients and FSDP2's reduce-scatter are unchanged. One graph may serve several
blocks (``runs_per_step``) and no plan sees the step, so ``policy="peak"`` and ``"budget"`` are refused. Past Dynamo's
``cache_size_limit`` layers run eagerly, unseen: raise it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from thunder_fp8shard.distributed.integrations.base import Integration

NAME = "FSDP2 (fully_shard) under ThunderFX"
HSDP_NAME = "FSDP2 HSDP (fully_shard over a 2-D mesh) under ThunderFX"
USAGE = (
    "FSDP2 under ThunderFX: fully_shard(block) for each block and fully_shard(model), then "
    "torch.compile(model, backend=thunder.dynamo.ThunderCompiler(transforms=[ShardIntermediates()]))"
)


@dataclass(frozen=True)
class _Input:
    tensor: torch.Tensor | None  # the real tensor Dynamo recorded, if it still holds it
    source: str


def dynamo_inputs(fn) -> dict[str, _Input] | None:
    """Placeholder name -> the real input Dynamo recorded, when ``fn`` is a graph made by Dynamo; else None."""
    if not isinstance(fn, torch.fx.GraphModule):
        return None
    placeholders = [n for n in fn.graph.nodes if n.op == "placeholder"]
    if not any("grapharg" in n.meta for n in placeholders):
        return None
    out = {}
    for n in placeholders:
        arg = n.meta.get("grapharg")
        if arg is None:
            out[n.name] = _Input(None, "an input Dynamo recorded nothing for")
            continue
        try:
            example = arg.example
        except Exception:  # noqa: BLE001 (a dead weak reference, or an erased grapharg)
            example = None
        out[n.name] = _Input(example if isinstance(example, torch.Tensor) else None, _source_name(arg.source))
    return out


def _source_name(source) -> str:
    try:
        return str(source.name)  # e.g. L['x'], L['self']._parameters['weight']
    except Exception:  # noqa: BLE001
        return str(source)


@dataclass(frozen=True)
class _Owner:
    """Where FSDP2 keeps an unsharded tensor identical: its parameter group's shard group and mesh."""

    group: object  # FSDP2's shard process group: the all-gather that made the tensor
    mesh_shape: tuple[int, ...]  # (shard,) or, under HSDP, (replicate, shard)
    mesh_ranks: tuple[int, ...]  # in mesh order (row-major: replicate outer, shard inner)


def unsharded_parameters() -> dict[int, _Owner]:
    """id(unsharded parameter) -> its owner, for every live FSDP2 parameter currently unsharded."""
    from torch.distributed._composable_state import _module_state_mapping
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    found = {}
    for ref in list(_module_state_mapping.values()):
        state = ref()
        group = getattr(state, "_fsdp_param_group", None) if isinstance(state, FSDPState) else None
        if group is None:
            continue
        info = group.mesh_info  # one owner for every parameter of the group
        owner = _Owner(info.shard_process_group, tuple(info.mesh.mesh.shape), tuple(info.mesh.mesh.flatten().tolist()))
        for p in group.fsdp_params:
            t = getattr(p, "_unsharded_param", None)
            if t is not None and p.sharded_state == ShardedState.UNSHARDED:
                found[id(t)] = owner
    return found


SUBGRAPH_NOTE = (
    "under ThunderFX this plan sees one subgraph: its predicted peak is this subgraph's program in the memory the step "
    "runs in (the other subgraphs' saved tensors are not in it), not the step's peak; Dynamo runs one subgraph for "
    "every block of the same class and shapes, so its bytes count runs_per_step times a step"
)


def detect(cd, options):
    inputs = dynamo_inputs(getattr(cd, "fn", None))
    if inputs is None:
        return None
    if not dist.is_initialized():
        raise RuntimeError("ShardIntermediates needs an initialized torch.distributed process group")
    if options.policy != "all":
        raise ValueError(
            f"ShardIntermediates: policy={options.policy!r} needs a plan that sees the whole training step, and under "
            "ThunderFX (FSDP2) each plan sees one subgraph: a block, which Dynamo may run for several blocks a step, "
            "so no plan can predict the step's peak or keep a budget. Use policy='all' (every sound candidate, and "
            "every compaction that frees more than it copies)"
        )
    owners = unsharded_parameters()
    found = {name: owners[id(i.tensor)] for name, i in inputs.items() if i.tensor is not None and id(i.tensor) in owners}
    if not found:
        if options.group is None:
            raise RuntimeError(
                "ShardIntermediates: this torch.compile subgraph has no FSDP2 (fully_shard) parameter among its inputs "
                f"({', '.join(inputs) or 'none'}), so no process group can be found; pass ShardIntermediates(group=...) "
                f"(nothing is sharded in such a subgraph) or use the pass as documented: {USAGE}"
            )
        note = ("no FSDP2 parameter enters this subgraph: nothing in it is provably identical on every rank, so nothing "
                "is sharded (the group is the group= option)")
        return Integration(f"{NAME}, subgraph without FSDP2 parameters", options.group,
                           input_reasons=lambda trace: _reasons(trace, inputs, {}, set()), notes=(note, SUBGRAPH_NOTE))
    first = next(iter(found.values()))  # group= must span its shard group's ranks (integrations.detect checks)
    roots = {name for name, o in found.items() if o.group is first.group and o.mesh_ranks == first.mesh_ranks}
    hsdp = len(first.mesh_shape) == 2
    return Integration(
        HSDP_NAME if hsdp else NAME, first.group,
        replicated_inputs=lambda trace: frozenset(n for n in _matching(trace, inputs) if n in roots),
        input_reasons=lambda trace: _reasons(trace, inputs, found, roots),
        notes=(_hsdp_note(first.mesh_shape, options), SUBGRAPH_NOTE) if hsdp else (SUBGRAPH_NOTE,),
        replica_ranks=first.mesh_ranks if hsdp else None,
    )


def _hsdp_note(shape: tuple[int, ...], options) -> str:
    replicate, shard = shape
    k = options.shard_group_size or shard
    note = (f"FSDP2 HSDP over a {replicate} x {shard} mesh (replicate x shard): the unsharded parameters are "
            f"all-gathered over the mesh's shard dimension (each shard group: {shard} consecutive ranks of the mesh); ")
    if k == shard:
        return note + f"the shards travel on it ({k} ranks, the default)"
    if shard % k == 0:
        return note + f"the shards travel on subgroups of {k} ranks within each shard group"
    return note + (f"the shards travel on runs of {k} ranks across shard groups: that the replicas hold the same "
                   "parameters is FSDP2's HSDP contract (identical initial weights on every replica, which fully_shard "
                   "assumes and does not check, then the same all-reduced gradients), not proven here; verify=True "
                   "checks it")


def _matching(trace, inputs: dict[str, _Input]) -> list[str]:
    """Trace inputs that are the graph inputs of the same name, with the real tensor's shape and dtype."""
    from thunder.core import dtypes

    return [p.name for p in _trace_tensor_inputs(trace)
            if (i := inputs.get(p.name)) is not None and i.tensor is not None
            and tuple(p.shape) == tuple(i.tensor.shape) and dtypes.to_torch_dtype(p.dtype) == i.tensor.dtype]


def _reasons(trace, inputs: dict[str, _Input], owned: dict, roots: set[str]) -> dict[str, str]:
    """Why each trace input that is not a root is per-rank."""
    matching = set(_matching(trace, inputs))
    reasons = {}
    for p in _trace_tensor_inputs(trace):
        i = inputs.get(p.name)
        if i is None:
            reasons[p.name] = f"the input `{p.name}`, not an input of the Dynamo graph"
        elif p.name not in owned:
            reasons[p.name] = f"the input `{p.name}` ({i.source}), not an unsharded FSDP2 parameter"
        elif p.name not in matching:
            reasons[p.name] = (f"the input `{p.name}` ({i.source}), whose shape or dtype differs from the FSDP2 "
                               "parameter Dynamo recorded for it")
        elif p.name not in roots:
            reasons[p.name] = f"the FSDP2 parameter `{p.name}`, all-gathered over another process group or mesh"
    return reasons


def _trace_tensor_inputs(trace):
    from thunder.core.proxies import TensorProxy

    from thunder_fp8shard.analysis.saved import forward_inputs

    return [p for p in forward_inputs(trace) if isinstance(p, TensorProxy)]
