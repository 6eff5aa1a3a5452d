"""PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``) under ThunderFX (``torch.compile(backend=ThunderCompiler(
transforms=[ShardIntermediates()]))``): the replicated roots are the subgraph inputs that are FSDP2's unsharded
parameters; the shards travel on FSDP2's shard process group.

How the pieces fit. Dynamo does not trace FSDP2's hooks (``torch._dynamo.config.skip_fsdp_hooks``, on by default):
the hooks run eagerly and the forward of each ``fully_shard``-ed module becomes its own graph (a graph break at each
module boundary), whether the whole model is compiled (as Thunder's ``benchmark_litgpt.py --distributed_mode=fsdp2
--compile=dynamo_thunder`` does) or each block (``block.compile(backend=...)``, torchtitan's way). ThunderFX hands
each graph's supported part to ``thunder.jit``; each such subgraph is one Thunder compilation with its own forward and
backward, planned and rewritten on its own. Dynamo lifts the module's parameters into graph inputs.

Why those inputs are identical on every rank. FSDP2's pre-forward hook runs before the compiled forward: it
all-gathers every parameter shard of the module over the shard group and copies the result into the parameter's
unsharded ``nn.Parameter`` (``FSDPParam._unsharded_param``), which it installs on the module; the compiled forward
reads the module's parameters, so the tensor entering the subgraph is that all-gathered parameter: the same bytes on
every rank of the group (mixed precision casts the shard before the all-gather). The pass proves this per input, not
by name: Dynamo records the real tensor behind each graph input (``node.meta["grapharg"]``), and an input is a root
only when it *is* (``is``) the ``_unsharded_param`` of a live FSDP2 parameter found through FSDP2's module states, in
the unsharded state, while the subgraph is compiled. Every other input (activations, parameters FSDP2 does not manage,
inputs whose real tensor Dynamo no longer holds) is per-rank, with the reason in the plan. The proof is made for the
module Dynamo compiled the graph for; Dynamo reuses the graph only for modules that pass its guards, and
``fully_shard`` gives its modules a class of their own (``FSDP<Name>``), so a layer FSDP2 does not manage never runs
an FSDP2 layer's graph (checked: it gets its own graph, refused). Not covered: layers of one class and shapes sharded
over two different meshes would share one graph whose shards travel on the first mesh's group; ``verify=True``
detects that at run time.

HSDP (``fully_shard(..., mesh=mesh)`` with a 2-D mesh, replicate x shard, as ``init_device_mesh(device, (nodes,
gpus_a_node), mesh_dim_names=("replicate", "shard"))`` makes it): FSDP2 all-gathers each parameter over the mesh's
shard dimension (``HSDPMeshInfo.shard_process_group``, the group the roots are proven on) and all-reduces the
reduce-scattered gradients over the replicate dimension, so every replica updates the same parameters with the same
gradients: the unsharded parameters are identical across the whole mesh, given identical initial weights on every
replica, which ``fully_shard`` assumes (it does not broadcast). The setup's group is the shard group, so the shards
default to the mesh's shard dimension (intra-node in that layout); ``shard_group_size=k`` partitions the whole mesh in
mesh order (row-major: each shard group is a run of consecutive ranks). A run within one shard group (k dividing the
shard dimension) is proven identical by the all-gather; a longer run relies on the replicas' identity (the plan says
so; ``verify=True`` checks it at run time).

Backward. The pass only replaces saved intermediates (e.g. the FP8 copies of those parameters) by shards and
all-gathers them back inside the subgraph's backward; the gradients the subgraph returns for the unsharded parameters
are bitwise those of the run without the pass, so FSDP2's post-backward reduce-scatter (its own hooks, outside the
subgraph) sees the same gradients. FSDP2 re-gathers the unsharded parameters themselves before the backward (with
``reshard_after_forward=True``); they are subgraph inputs, which the pass never shards.

Dynamo compiles a layer's forward once per grad mode and shape kind (static, then dynamic), all on one code object
when the layers share a class: past ``torch._dynamo.config.cache_size_limit`` (8) it silently runs the rest eagerly,
where the pass does not see them. Raise the limit (Thunder's benchmark_litgpt sets 64 for FSDP2). Under torch 2.11
Dynamo inlines the built-in modules and reuses one graph for every block of the same class and shapes: one Thunder
compilation, hence one plan, serves all of them, and runs once a block a step. The pass counts those runs at run time
(its run report's ``runs_per_step``, see :mod:`thunder_fp8shard.runtime.audit`); a step's totals are each plan times its runs.

Each plan sees one subgraph, not the step: its predicted peak is that subgraph's program in the memory the step runs
in. So ``policy="peak"`` and ``policy="budget"``, which need the step's peak, are refused here with a clear error;
``policy="all"`` shards every sound candidate and compacts where a copy frees more than it copies.

Detection and the process group: a compilation is this setup when its function is a Dynamo graph (placeholders with
``grapharg`` metadata). The group is the shard group of the FSDP2 parameters entering it (``group=`` may name it too
and must then span the same ranks). A subgraph without any FSDP2 parameter (e.g. Dynamo split a block between two
graphs) names no group: the pass then needs ``group=`` and shards nothing there (no roots), saying so in the plan;
without ``group=`` it raises.
"""

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
    tensor: torch.Tensor | None  # the real tensor Dynamo recorded for this graph input, if it still holds it
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
        except Exception:  # noqa: BLE001  (a weak reference that died, or an erased grapharg)
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
    """Where FSDP2 keeps an unsharded tensor identical: its parameter group's shard process group and mesh."""

    group: object  # FSDP2's shard process group: the all-gather that made the tensor
    mesh_shape: tuple[int, ...]  # (shard,) or, under HSDP, (replicate, shard)
    mesh_ranks: tuple[int, ...]  # the mesh's global ranks, in mesh order (row-major: replicate outer, shard inner)


def unsharded_parameters() -> dict[int, _Owner]:
    """id(unsharded parameter) -> its owner, for every live FSDP2 parameter that is currently unsharded
    (all-gathered)."""
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
    first = next(iter(found.values()))  # group= must span its shard group's ranks (checked by integrations.detect)
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

    out = []
    for p in _trace_tensor_inputs(trace):
        i = inputs.get(p.name)
        if i is not None and i.tensor is not None and tuple(p.shape) == tuple(i.tensor.shape) and (
                dtypes.to_torch_dtype(p.dtype) == i.tensor.dtype):
            out.append(p.name)
    return out


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
