"""What is alive at a training step's device peak, and which line of which program allocated it: one simulated rank
(rank 0 of N in torch's fake process group) of ``thunder_fp8shard.testing.litgpt_run``'s run (the GPU tests' tiny
litgpt model by default), with and without the pass. A CUDA memory history of one step after the first is replayed
to the step's peak (``torch.cuda.memory._record_memory_history``; the blocks allocated and not yet freed at the
largest sum), and the blocks alive there are grouped by the line that allocated them: the statement of Thunder's
generated program (read from ``linecache``, where Thunder registers its programs), else the innermost frame of ours,
TransformerEngine's or the test run's. Prints one table a run and the difference of the two (with minus without).

Usage (on a CUDA machine, TransformerEngine installed)::

    python benchmarks/memory_at_peak.py --setup ddp --out /tmp/peak   # zero3, zero2, ddp (the GPU tests' setups)
"""

from __future__ import annotations

import argparse
import collections
import json
import linecache
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

OURS = ("thunder_fp8shard", "transformer_engine", "litgpt_run", "memory_at_peak")


def site(frames: list[dict]) -> str:
    """Where a block was allocated: the innermost frame in a program Thunder generated (with its statement), else
    the innermost frame of ours, TE's or the run's, else the innermost frame."""
    for f in frames:
        if f["filename"].startswith("thunder."):
            text = linecache.getline(f["filename"], f["line"]).strip()
            return f"{f['filename'].split('_')[0]}:{f['name']}: {text[:140]}"
    for f in frames:
        if any(k in f["filename"] for k in OURS):
            return f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}"
    return f"{frames[0]['filename']}:{frames[0]['line']} {frames[0]['name']}" if frames else "?"


def live_at_peak(events: list[dict]) -> tuple[int, int, dict]:
    """``(peak bytes over the start, event index, {address: (bytes, site)})``: the allocation history replayed
    (an ``alloc`` adds its block, ``free_completed`` removes it: when the allocator's allocated-bytes count falls)."""
    live, cur, peak, at, at_peak = {}, 0, 0, -1, {}
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], e.get("frames", []))
            cur += e["size"]
            if cur > peak:
                peak, at, at_peak = cur, i, dict(live)
        elif e["action"] == "free_completed" and e["addr"] in live:
            cur -= live.pop(e["addr"])[0]
    return peak, at, {a: (n, site(fr)) for a, (n, fr) in at_peak.items()}


def rank_fn(rank: int, world_size: int, cfg, steps: int) -> dict:
    import torch

    from thunder_fp8shard.testing import litgpt_run as bench

    s = bench.setup_rank(rank, cfg)
    gen = torch.Generator().manual_seed(1000 + rank)
    out = {}
    for step in range(steps):
        idx = torch.randint(0, s.vocab_size, (cfg.micro_batch_size, cfg.seq_len + 1), generator=gen).to(s.device)
        x, y = idx[:, :-1], idx[:, 1:]
        last = step == steps - 1
        torch.cuda.synchronize()
        if last:
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        logits = s.jm(x)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        torch.cuda.synchronize()
        fwd_peak = torch.cuda.max_memory_allocated()
        loss.backward()
        torch.cuda.synchronize()
        if last:
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            events = next(t for t in snap["device_traces"] if t)
            peak, at, live = live_at_peak(events)
            by_site = collections.Counter()
            for n, where in live.values():
                by_site[where] += n
            out = {"base": base, "replayed_peak": base + peak, "max_memory_allocated": torch.cuda.max_memory_allocated(),
                   "forward_peak": fwd_peak, "peak_event": at, "events": len(events),
                   "peak_site": site(events[at].get("frames", [])) if at >= 0 else None,
                   "by_site": dict(by_site.most_common())}
        s.opt.step()
        s.opt.zero_grad(set_to_none=True)
        del logits, loss
    if s.shard is not None and s.shard.plans:
        out["plan"] = s.shard.describe()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setup", default="ddp", choices=["zero3", "zero2", "ddp"])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from thunder_fp8shard.testing import litgpt_run as bench
    from thunder_fp8shard.testing.harness import run_simulated

    res = {}
    for shard in (False, True):
        cfg = bench.RunConfig(**bench.TINY, setup=args.setup, shard=shard, steps=args.steps)
        res["with" if shard else "without"] = run_simulated(rank_fn, args.world_size, cfg, args.steps)
    for name, r in res.items():
        print(f"== {args.setup} {name}: peak {r['replayed_peak']:,} B replayed ({r['max_memory_allocated']:,} B "
              f"max allocated, forward {r['forward_peak']:,}); at event {r['peak_event']} of {r['events']}: "
              f"{r['peak_site']}")
        for where, n in list(r["by_site"].items())[:40]:
            print(f"  {n:>12,}  {where}")
    a, b = res["without"]["by_site"], res["with"]["by_site"]
    print(f"== {args.setup} with - without, by site (peak {res['with']['replayed_peak'] - res['without']['replayed_peak']:+,} B)")
    for where in sorted(set(a) | set(b), key=lambda w: -abs(b.get(w, 0) - a.get(w, 0))):
        d = b.get(where, 0) - a.get(where, 0)
        if d:
            print(f"  {d:>+12,}  {where}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"memory_at_peak_{args.setup}.json"), "w") as f:
            json.dump({"setup": args.setup, "config": bench.TINY, **res}, f, indent=1)


if __name__ == "__main__":
    main()
