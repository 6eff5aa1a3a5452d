"""Fingerprints of the pass's plans and rewritten traces on the test models: the check that a refactor changed no
behaviour. Run it before and after, and compare the two JSONs (they must be equal).

Each configuration runs in a fresh process as rank 0 of N under torch's fake process group
(``testing.harness.run_simulated``: the plans and traces of rank 0 of a real run), compiles its model, trains two
steps, and records every plan's collectives (``agreement.collectives``, what every rank compares), decisions,
compactions, saved bytes, predicted peaks and operator calls, and the executed forward and backward traces with
their proxy names (Thunder names proxies deterministically in a fresh process). Usage::

    python benchmarks/plan_fingerprints.py --out /tmp/before.json   # on the old revision
    python benchmarks/plan_fingerprints.py --out /tmp/after.json    # on the new one
    cmp /tmp/before.json /tmp/after.json

Where the test models themselves changed (the way they are written, not what they compute), the proxy names and the
source lines the traces quote change too, and where the pass's modules moved, the names the traces give the pass's
objects (``_thunder_fp8shard_runtime_ops_ShardSpec_4``: module path, class, counter): ``--compare before.json
after.json`` compares the configurations with proxy names renamed in order of appearance, the quoted source and
those module paths left out (:func:`same_behaviour`), and exits non-zero where one differs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [p for p in (os.path.dirname(HERE),) if p not in sys.path]

WIDTHS = (25, 61, 47, 7)
LARGE = (256, 320)
# (name, world size, reference_run.RunConfig fields) and litgpt_run toy configurations (name, world size, fields)
MLP = [
    ("zero3-defaults", 2, {"options": {"min_bytes": 0}}),
    ("zero3-n3-singles-prefetch0", 3, {"options": {"min_bytes": 0, "bucket_bytes": 0, "prefetch": 0}}),
    ("zero3-large-reduce-scatter", 3, {"batch_sizes": LARGE, "options": {"min_bytes": 0, "method": "reduce_scatter",
                                                                          "prefetch": 0}}),
    ("fsdp-api-cap-prefetch2", 2, {"batch_sizes": LARGE, "api": "fsdp", "options": {
        "min_bytes": 0, "prefetch": 2, "bucket_bytes": 3200, "comm": "dedicated"}}),
    ("zero3-all-candidates", 2, {"options": {"min_bytes": 64, "candidates": "all"}}),
    # rows that divide among the ranks: the gathered weights' shards are their parameters' (analysis.own_shards)
    ("zero3-all-own-shards", 2, {"widths": (24, 64, 47, 8), "options": {"min_bytes": 64, "candidates": "all"}}),
    ("zero3-peak", 2, {"options": {"min_bytes": 0, "policy": "peak", "optimizer_states": 0}}),
    ("zero3-budget", 2, {"options": {"min_bytes": 0, "policy": "budget", "budget_bytes": 79_000,
                                     "optimizer_states": 0}}),
    ("zero3-resident", 2, {"options": {"min_bytes": 0, "resident_bytes": 200 << 20, "loss_bytes": 0}}),
    ("zero2", 2, {"sharding_strategy": "ZERO2", "options": {"min_bytes": 0}}),
    ("ddp", 2, {"api": "ddp", "options": {"min_bytes": 0}}),
    ("zero3-subgroups", 4, {"options": {"min_bytes": 0, "shard_group_size": 2}}),
    ("fsdp2-model", 2, {"api": "fsdp2", "options": {"min_bytes": 0}}),
]
TOY = dict(model="toy", n_layer=2, n_embd=64, n_head=4, intermediate_size=96, vocab_size=128, seq_len=16,
           micro_batch_size=2, steps=2, te=False, device="cpu", extra={"min_bytes": 0})
LLAMA = [("toy-llama-zero3-cat", 2, {"setup": "zero3"}), ("toy-llama-fsdp2-cat", 2, {"setup": "fsdp2"})]


def _plan_record(plan, report=None) -> dict:
    """A plan's fingerprint after the run: its prediction as the run-time audit corrected it (``report``)."""
    from thunder_fp8shard.distributed.agreement import collectives

    if report is not None:
        plan = report.corrected(plan)
    return {
        "collectives": collectives(plan, verify=False),
        "decisions": [dataclasses.asdict(d) for d in plan.decisions],
        "compactions": [dataclasses.asdict(c) for c in getattr(plan, "compactions", [])],
        "saved": [plan.saved_bytes_before, plan.saved_bytes_after],
        "peaks": [plan.peak_bytes_before, plan.peak_bytes_after, plan.program_peak_bytes_before,
                  plan.program_peak_bytes_after],
        "terms": [[t.name, t.source, list(map(list, t.spans))] for t in plan.terms],
        "notes": list(plan.notes), "operator_calls": dict(plan.operator_calls),
    }


def mlp_fingerprint(rank, world_size, fields):
    from thunder_fp8shard.testing.reference_run import RunConfig, train

    cfg = RunConfig(**{"widths": WIDTHS, "batch_sizes": (3, 5), "no_grad_call": False, **fields})
    result = train(rank, world_size, cfg)
    return {"plans": [_plan_record(p, r) for p, r in zip(result.plans, result.reports)], "traces": list(result.traces)}


def llama_fingerprint(rank, world_size, fields):
    import thunder

    from thunder_fp8shard.testing import litgpt_run

    import torch

    s = litgpt_run.setup_rank(rank, litgpt_run.RunConfig(**TOY, **fields))
    gen = torch.Generator().manual_seed(1000 + rank)
    for _ in range(TOY["steps"]):
        idx = torch.randint(0, s.vocab_size, (TOY["micro_batch_size"], TOY["seq_len"] + 1), generator=gen)
        logits = s.jm(idx[:, :-1])
        torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1)).backward()
        s.opt.step()
        s.opt.zero_grad(set_to_none=True)
    traces = []
    if fields["setup"] != "fsdp2":
        entry = thunder.compile_stats(s.jm).interpreter_cache[0]
        traces = [str(entry.computation_traces[-1]), str(entry.backward_traces[-1])]
    return {"plans": [_plan_record(p, r) for p, r in zip(s.shard.plans, s.shard.reports)], "traces": traces}


# the names a trace gives proxies and parameters (renamed by order of appearance when comparing)
NAMES = re.compile(r"\b(?:(?:t|restore|gather|ft)\d+|t_[A-Za-z0-9_]+|weight|w|x|eps)\b")
# the trace's name of one of the pass's objects: its module's path, its class and a counter
# (``_thunder_fp8shard_runtime_ops_ShardSpec_4``); the module's path is left out when comparing
CONSTANT = re.compile(r"\b_thunder_fp8shard_\w*?_([A-Z][A-Za-z0-9]*_\d+)\b")


def _renamed(text: str, names: dict) -> str:
    return NAMES.sub(lambda m: names.setdefault(m.group(0), f"P{len(names)}"), text)


def normalized(record: dict) -> tuple[list[str], str]:
    """A configuration's traces (their lines without the source lines they quote, the pass's objects without their
    module's path) and plans, names renamed in order of appearance (traces first, then the plans, with the same
    renaming)."""
    names: dict = {}
    lines = [_renamed(CONSTANT.sub(r"_thunder_fp8shard_\1", re.sub(r"\s+# .*$", "", line)), names)
             for t in record["traces"] for line in t.splitlines() if not line.strip().startswith("#")]
    return lines, _renamed(json.dumps(record["plans"], sort_keys=True), names)


def same_behaviour(before: dict, after: dict) -> list[str]:
    """The configurations whose traces or plans differ other than by names and quoted source (sorted)."""
    return sorted(k for k in set(before) | set(after)
                  if k not in before or k not in after or normalized(before[k]) != normalized(after[k]))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out")
    p.add_argument("--only", nargs="*", help="configuration names (default: all)")
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two fingerprint files")
    a = p.parse_args(argv)
    if a.compare:
        before, after = (json.load(open(f)) for f in a.compare)
        differ = same_behaviour(before, after)
        print(f"{len(before)} configuration(s); differing other than by names: {differ or 'none'}")
        raise SystemExit(1 if differ else 0)
    if not a.out:
        p.error("--out is required (or --compare)")
    from thunder_fp8shard.testing.harness import run_simulated

    out = {}
    for fingerprint, configs in ((mlp_fingerprint, MLP), (llama_fingerprint, LLAMA)):
        for name, n, fields in configs:
            if not a.only or name in a.only:
                out[name] = run_simulated(fingerprint, n, fields, timeout_s=3600)
                print(f"{name}: {len(out[name]['plans'])} plan(s)", flush=True)
                with open(a.out, "w") as f:  # after each configuration: what ran is kept
                    json.dump(out, f, indent=1, sort_keys=True, default=str)


if __name__ == "__main__":
    main()
