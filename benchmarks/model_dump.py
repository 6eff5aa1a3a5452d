"""The pass's memory model of a real run, saved as plain JSON, and the grouping replayed on it (CPU, no GPU).

A GPU run of ``thunder_litgpt.py --dump-model DIR`` saves, for the training cache entry, the memory model the
planner used (storages, steps, placements of the candidates, the terms besides the program) and the sharded
decisions, as ``model_rank0.json.gz``. Here they load back into a :class:`~thunder_fp8shard.memory_model.MemoryModel`,
so that the grouping (``bucket_bytes``, ``prefetch``, ``grouping.HEADROOM``) can be tried on the real model on
any machine:

    python benchmarks/model_dump.py benchmarks/results/model_l32.json.gz --bucket-bytes 268435456 --prefetch 1
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def dump(model, decisions, world_size: int, path: str) -> None:
    """Writes ``model`` (a MemoryModel) and the sharded ``decisions`` to ``path`` (gzipped JSON)."""
    data = {
        "world_size": world_size,
        "steps": [[s.index, s.phase, s.label] for s in model.steps],
        "lives": [[life.name, list(life.members), life.nbytes, life.start, life.end] for life in model.lives.values()],
        "placements": {n: [p.life, p.shard_at, p.first_use] for n, p in model.placements.items()},
        "compute": [int(c) for c in model.compute],
        "terms": [[t.name, t.source, t.how, [list(s) for s in t.spans]] for t in model.terms],
        "sharded": [[d.name, list(d.shape), d.dtype, d.kind, d.nbytes, d.shard_nbytes] for d in decisions if d.sharded],
    }
    with gzip.open(path, "wt") as f:
        json.dump(data, f)


def load(path: str):
    """(MemoryModel, sharded decisions, world size) from a :func:`dump` file."""
    from thunder_fp8shard.liveness import Life, Step
    from thunder_fp8shard.memory_model import MemoryModel, Placement
    from thunder_fp8shard.plan import Decision, MemoryTerm

    with gzip.open(path, "rt") as f:
        d = json.load(f)
    model = MemoryModel(
        lives={n: Life(n, tuple(m), b, s, e) for n, m, b, s, e in d["lives"]},
        steps=tuple(Step(i, phase, label) for i, phase, label in d["steps"]),
        placements={n: Placement(life, a, u) for n, (life, a, u) in d["placements"].items()},
        compute=tuple(bool(c) for c in d["compute"]),
        terms=tuple(MemoryTerm(n, src, how, tuple(tuple(s) for s in spans)) for n, src, how, spans in d["terms"]),
    )
    decisions = [Decision(n, tuple(shape), dtype, kind, nbytes, True, True, "", shard)
                 for n, shape, dtype, kind, nbytes, shard in d["sharded"]]
    return model, decisions, d["world_size"]


def replay(path: str, bucket_bytes: int, prefetch: int) -> dict:
    """The grouping of the dumped run's sharded tensors under other options, and its predicted peaks."""
    from thunder_fp8shard.planner import schedule

    model, decisions, world_size = load(path)
    buckets = schedule(decisions, model, prefetch=prefetch, bucket_bytes=bucket_bytes, world_size=world_size)
    singles = schedule(decisions, model, prefetch=prefetch, bucket_bytes=0, world_size=world_size)
    before, after, alone = model.evaluate([]), model.evaluate(buckets), model.evaluate(singles)
    return {
        "buckets": len(buckets), "shard_ops": len({b.shard_op for b in buckets}),
        "bucket_members": [len(b.members) for b in buckets],
        "peak_before": before.peak_bytes, "peak_after": after.peak_bytes, "peak_one_tensor_a_bucket": alone.peak_bytes,
        "peak_step": [after.peak_step.phase, after.peak_step.index, after.peak_step.label],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path")
    p.add_argument("--bucket-bytes", type=int, default=256 << 20)
    p.add_argument("--prefetch", type=int, default=1)
    a = p.parse_args()
    print(json.dumps(replay(a.path, a.bucket_bytes, a.prefetch), indent=1))


if __name__ == "__main__":
    main()
