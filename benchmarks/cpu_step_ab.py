"""Two versions of the pass in one process: what each adds to the CPU time of a whole Thunder step (fake group).

``cpu_step_cost.py`` compares a step with and without the pass; but each process runs at a speed of its own (third
sitting: one configuration measured 0.7-3.6 ms in different processes), so two versions of the pass measured in two
processes cannot be told apart at a few hundred microseconds. This runs both in one process: the package of another
revision (``--against``, default ``main``) is extracted with ``git archive`` into a temporary directory and imported
as ``thunder_fp8shard_ab`` (its operators renamed to match), then ``--compilations`` compiled models a side
(without the pass, with the other revision's, with this checkout's) run interleaved steps, as ``cpu_step_cost.py``
does: the fake-FP8 Llama under Thunder FSDP ZeRO-3 in torch's fake process group, the medians of the process's CPU
time a step. Both versions must make the same plan (buckets, shard ops, their bytes, predicted peaks); it raises if
not. Results under a fake group are not numerically meaningful; gradients are compared by the tests, not here.

    python benchmarks/cpu_step_ab.py --layers 8 32 --against main --compilations 2
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

OTHER = "thunder_fp8shard_ab"


def import_revision(rev: str, into: str):
    """The pass package of git revision ``rev``, extracted under ``into`` and imported as ``thunder_fp8shard_ab``
    (its imports, executor and operator names renamed, so that both versions coexist in one process)."""
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev, "thunder_fp8shard"], check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            path = os.path.join(into, OTHER, os.path.relpath(member.name, "thunder_fp8shard"))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            text = tar.extractfile(member).read().decode()
            if member.name.endswith(".py"):
                text = re.sub(r"\bthunder_fp8shard\b", OTHER, text).replace('"fp8shard', '"fp8shard_ab')
            with open(path, "w") as f:
                f.write(text)
    sys.path.insert(0, into)
    return importlib.import_module(OTHER)


def _plan_key(plan) -> tuple:
    return ([(b.members, b.shard_op, b.shard_offset, b.shard_nbytes) for b in plan.buckets],
            plan.peak_bytes_before, plan.peak_bytes_after, plan.saved_bytes_before, plan.saved_bytes_after)


def measure(n_layer: int, options: dict, steps: int, compilations: int, other: type, rev: str) -> dict:
    from cpu_step_cost import _compile

    from thunder_fp8shard import ShardIntermediates

    sides = {"without": None, rev: other, "this": ShardIntermediates}
    runs = [(side, *_compile(n_layer, None if cls is None else options, cls))
            for _ in range(compilations) for side, cls in sides.items()]
    plans = {side: plan for side, _, _, plan, _ in runs if plan is not None}
    if _plan_key(plans[rev]) != _plan_key(plans["this"]):
        raise RuntimeError(f"the two versions planned differently at {n_layer} layers: not a comparison of the same work")
    cpu: list[list[float]] = [[] for _ in runs]
    for _ in range(steps):
        for k, (_, jm, idx, _, _) in enumerate(runs):
            start = time.process_time()
            jm(idx).sum().backward()
            cpu[k].append((time.process_time() - start) * 1e3)
    per_run = {side: [statistics.median(cpu[k]) for k, r in enumerate(runs) if r[0] == side] for side in sides}
    median = {side: statistics.median(m) for side, m in per_run.items()}
    plan = plans["this"]
    return {
        "n_layer": n_layer, "options": options, "against": rev, "steps": steps, "compilations": compilations,
        "median_step_cpu_ms": median, "per_compilation_median_cpu_ms": per_run,
        "overhead_ms": {side: median[side] - median["without"] for side in sides if side != "without"},
        "sharded": len(plan.sharded), "buckets": len(plan.buckets), "shard_ops": len({b.shard_op for b in plan.buckets}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--options", type=json.loads, default={"min_bytes": 0}, help="ShardIntermediates options (JSON)")
    parser.add_argument("--against", default="main", help="the git revision to compare this checkout with")
    parser.add_argument("--world-size", type=int, default=2, help="ranks the fake group claims (default 2)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--compilations", type=int, default=2, help="compiled models a side (default 2)")
    parser.add_argument("--out", default="benchmarks/results/cpu_step_ab.json")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
    with tempfile.TemporaryDirectory() as into:
        other = import_revision(args.against, into).ShardIntermediates
        rows = []
        for n_layer in args.layers:
            rows.append(measure(n_layer, args.options, args.steps, args.compilations, other, args.against))
            print(json.dumps(rows[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump({"world_size": args.world_size, "torch": torch.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
