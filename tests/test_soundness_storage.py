"""Sharding frees a storage, not a tensor (issue #33): a saved tensor whose storage is a program input's (a
parameter's ``shallow_copy`` under DDP) is never sharded, and a view counts as its storage's bytes (an ``expand`` of a
LayerNorm weight is not sharded into a shard larger than its storage). On real Thunder traces of a pre-norm MLP,
compiled once in this process (world size 1), planned as for 2 ranks."""

import pytest
import torch

from thunder_fp8shard.analysis.program import program_facts
from thunder_fp8shard.distributed.integrations.base import Integration
from thunder_fp8shard.distributed.integrations.thunder_ddp import replicated_parameters
from thunder_fp8shard.analysis.liveness import storage_of
from thunder_fp8shard.options import ShardOptions
from thunder_fp8shard.pipeline import analysis_of, found
from thunder_fp8shard.rewrite.shape import Program
from thunder_fp8shard.planning.planner import soundness
from thunder_fp8shard.testing.toy_models import PreNormMLP

D, BATCH = 32, (4, 8)


def _traces(setup):
    import thunder
    from thunder.distributed import FSDPType, ddp
    from thunder.distributed.transforms.fsdp_v2 import FSDPTransform

    torch.manual_seed(0)
    if setup == "ddp":
        jm = ddp(thunder.jit(PreNormMLP(D)))
    else:
        jm = thunder.jit(PreNormMLP(D), transforms=[FSDPTransform(device=torch.device("cpu"),
                                                                  sharding_strategy=FSDPType.ZERO3)])
    jm(torch.randn(*BATCH, D, requires_grad=True)).sum().backward()
    entry = thunder.compile_stats(jm).interpreter_cache[0]
    return entry.computation_traces[-1], entry.backward_traces[-1], thunder.compile_data(jm).process_group_for_ddp


def _decisions(setup, group_and_traces):
    fw, bw, group = group_and_traces
    inputs = replicated_parameters if setup == "ddp" else (lambda trace: frozenset())
    integration = Integration(setup, group, replicated_inputs=inputs)
    options = ShardOptions(candidates="all", min_bytes=0)
    a = analysis_of(*found(Program(program_facts(fw, bw), options, integration)), None)  # no shard group
    decisions = soundness(list(a.candidates), a.replication, set(a.model_io), options, 2, a.model, set(a.saved_names))
    return {d.name: d for d in decisions}, a


@pytest.mark.parametrize("setup", ["ddp", "zero3"])
def test_what_is_sharded_frees_its_storage_and_counts_its_storage_bytes(single_rank_group, setup):
    decisions, a = _decisions(setup, _traces(setup))
    life_of = storage_of(a.model.lives)
    inputs = set(a.model_io)
    for d in decisions.values():
        life = life_of[d.name]
        assert d.storage_nbytes == life.nbytes
        if d.sharded:  # its storage is no input's, and it frees more than it keeps
            assert not inputs & set(life.members), d
            assert d.bytes_saved == life.nbytes - d.shard_nbytes > 0, d
    replicated = [d for d in decisions.values() if d.replicated]
    assert replicated
    if setup == "ddp":
        # every replicated saved tensor is a parameter's alias (shallow_copy, unsqueeze, expand): none is sharded
        assert not any(d.sharded for d in decisions.values())
        assert all("its storage is that of the program's input or output t_" in d.reason for d in replicated)
    else:
        expanded = [d for d in decisions.values() if d.nbytes > d.storage_nbytes]
        # the LayerNorm weights (D floats) expanded to the activation's shape: D * 4 B of storage, not 4 * 8 * D * 4;
        # not identical on a rank that compiles another batch shape (the expand's shape is the activation's)
        assert {(d.storage_nbytes, d.nbytes) for d in expanded} == {(D * 4, BATCH[0] * BATCH[1] * D * 4)}
        assert all(not d.sharded and not d.replicated for d in expanded)
        assert sum("a shape the program's constants set (`expand`)" in d.reason for d in expanded) == 2  # the weights
        weights = [d for d in replicated if d.shape == (D, D)]
        assert len(weights) >= 4 and all(d.sharded and d.bytes_saved == D * D * 2 for d in weights)
