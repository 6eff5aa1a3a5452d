"""Saved tensors whose shard already exists: under Thunder FSDP this rank's rows of a saved gathered weight *are* its
parameter shard, when the gather ran over the shard group in order, unpadded, of an input the forward does not write.
Sharding it copies nothing."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from thunder.core.proxies import TensorProxy

from thunder_fp8shard.analysis.program import ProgramFacts
from thunder_fp8shard.analysis.saved import tensor_nbytes


def group_ranks(group) -> tuple[int, ...] | None:
    """The global ranks of a process group, in group order (None: not a group ``torch.distributed`` knows)."""
    import torch.distributed as dist

    try:
        return tuple(dist.get_process_group_ranks(group))
    except Exception:  # noqa: BLE001 (not initialized, not a ProcessGroup, ...)
        return None


def own_shards(facts: ProgramFacts, candidates: Iterable[str], inputs: Iterable[TensorProxy], *,
               ranks: tuple[int, ...], group_ranks=group_ranks) -> Mapping[str, TensorProxy]:
    """Each candidate that is ``wait(all_gather(input))`` (a gather chain,
    :func:`~thunder_fp8shard.analysis.fsdp_gathers.forward_gathers`) over ``ranks``, along dim 0, of exactly
    ``len(ranks)`` times the input's bytes, with an unwritten input: the candidate -> that input (each input serves one
    candidate)."""
    wanted = set(candidates)
    by_name = {p.name: p for p in inputs}
    written = _written(facts.forward)
    out: dict[str, TensorProxy] = {}
    taken: set[str] = set()
    for g in sorted(facts.gathers, key=lambda g: g.wait_at):
        src, result = g.shard, g.gathered
        if (isinstance(src, TensorProxy) and src.name in by_name and src.name not in written and g.dim in (None, 0)
                and result.name in wanted and src.name not in taken and result.dtype == src.dtype
                and tensor_nbytes(result) == len(ranks) * tensor_nbytes(src) and group_ranks(g.group) == ranks):
            out[result.name] = src
            taken.add(src.name)
    return out


def _written(fw: TraceCtx) -> set[str]:
    """Names of forward tensors a bound symbol may write in place: every tensor argument of a ``copy_`` (argument order
    differs between Thunder and torch), the first argument of any other in-place method."""
    out = set()
    for b in fw.bound_symbols:
        name = b.sym.name
        if name in ("copy_", "copy_with_setitem"):
            out.update(a.name for a in b.flat_proxy_args if isinstance(a, TensorProxy))
        elif name.endswith("_") and not name.startswith("_") and b.args and isinstance(b.args[0], TensorProxy):
            out.add(b.args[0].name)
    return out
