"""Where the pass's CPU goes, at run time (from paired JSONs) and at compilation (measured). Subcommands:

- ``ops JSON... [--top 8]``: the CPU a step of the operators ``paired.py --decompose-iters`` timed, as markdown;
- ``cprofile JSON [--base without] [--arm default] [--top 30]``: two arms' Python functions (``paired.py --cprofile``);
- ``compile [--layers 8 16 32] [--out benchmarks/results/pass_cost.json]``: the pass's hooks at compilation against
  the whole first call (CPU, 2 gloo ranks), as JSON.
"""

from __future__ import annotations

import json
import os
import platform
import time

from benchlib.reporting import load, subcommands


def table(r: dict, top: int) -> str:
    """One comparison's ``pass_cpu`` as a heading line and a markdown table of its ``top`` operators."""
    p = r["pass_cpu"]
    kind = "null arm: the A/A check" if r.get("null") else "with the pass"
    wall = f" (wall {p['net_wall_ms_per_step']:+.3f})" if "net_wall_ms_per_step" in p else ""
    lines = [f"**{r['arm']}** vs {r['base']} ({kind}): net {p['net_ms_per_step']:+.3f} ms of CPU a step{wall}, gross "
             f"{p['gross_ms_per_step']:.3f} ms ({p['iterations']} iterations a side; "
             f"{r.get('sim_collectives') or 'real'} collectives)", "",
             "| operator | pass's | calls (arm / base) | ms a step (arm / base) | difference ms |",
             "|---|---|---|---|---|"]
    for o in p["by_operator"][:top]:
        lines.append(f"| `{o['operator']}` | {'yes' if o['pass'] else ''} | {o['arm_calls']:g} / "
                     f"{o['base_calls']:g} | {o['arm_ms']:.3f} / {o['base_ms']:.3f} | {o['diff_ms']:+.3f} |")
    return "\n".join(lines)


def ops(a) -> None:
    """Where the pass's CPU goes, from paired JSONs (``paired.py --decompose-iters``): per JSON and arm, the net CPU ms
    a step the pass adds on the timed operators (the arm's less the base's), the gross (its own operators alone), and
    the operators that differ most, as markdown."""
    for path in a.jsons:
        r = load(path)
        if r.get("kind") != "paired":
            continue
        print(f"## {path}\n")
        print((table(r, a.top) if r.get("pass_cpu") else "no pass_cpu (run with --decompose-iters K > 0)") + "\n")


def diff(profile: dict, base: str, arm: str) -> list[tuple[str, float, float, float, float]]:
    """``(function, base calls, arm calls, base own ms, arm own ms)`` for every function of either arm."""
    a, b = profile["arms"][base], profile["arms"][arm]
    rows = []
    for key in set(a) | set(b):
        ca, ta = (a.get(key) or [0, 0, 0])[:2]
        cb, tb = (b.get(key) or [0, 0, 0])[:2]
        rows.append((key, ca, cb, ta, tb))
    return sorted(rows, key=lambda r: -abs(r[4] - r[3]))


def cprofile(args) -> None:
    """Where one arm's Python time a step differs from another's, from a paired JSON run with ``--cprofile K``: the
    functions whose own time a step differs most (calls and own ms a step in each arm, and the difference), and the
    totals of own time."""
    profile = load(args.json)["op_cpu"]["cprofile"]
    rows = diff(profile, args.base, args.arm)
    print(f"| function | calls {args.base} | calls {args.arm} | own ms {args.base} | own ms {args.arm} | diff |")
    print("|---|---|---|---|---|---|")
    for key, ca, cb, ta, tb in rows[: args.top]:
        print(f"| `{key}` | {ca:g} | {cb:g} | {ta:.3f} | {tb:.3f} | {tb - ta:+.3f} |")
    total = {n: sum(v[1] for v in profile["arms"][n].values()) for n in (args.base, args.arm)}
    print(f"\nown ms a step, the top functions kept: {args.base} {total[args.base]:.1f}, "
          f"{args.arm} {total[args.arm]:.1f}")


def measure(rank: int, world_size: int, n_layer: int) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    import thunder
    import torch
    from thunder.distributed import FSDPType
    from thunder.distributed.transforms.fsdp_v2 import FSDPTransform

    from thunder_fp8shard import ShardIntermediates
    from thunder_fp8shard.testing.toy_models import FakeFP8Llama

    class Timed(ShardIntermediates):
        seconds = 0.0

        def transform_trace_post_optimization(self, trace, **kwargs):
            start = time.perf_counter()
            try:
                return super().transform_trace_post_optimization(trace, **kwargs)
            finally:
                Timed.seconds += time.perf_counter() - start

    torch.manual_seed(0)
    shard = Timed()
    fsdp = FSDPTransform(device=torch.device("cpu"), sharding_strategy=FSDPType.ZERO3)
    jm = thunder.jit(FakeFP8Llama(n_layer), transforms=[fsdp, shard])
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank))
    start = time.perf_counter()
    jm(idx).sum().backward()
    first_call = time.perf_counter() - start
    plan = shard.plans[-1]
    return {
        "n_layer": n_layer, "first_call_s": first_call, "pass_s": Timed.seconds,
        "pass_fraction": Timed.seconds / first_call, "candidates": len(plan.decisions), "sharded": len(plan.sharded),
        "forward_bound_symbols": len(thunder.last_traces(jm)[-1].bound_symbols),
        "backward_bound_symbols": len(thunder.last_backward_traces(jm)[-1].bound_symbols),
    }


def compile_cost(args) -> None:
    """Cost of the ShardIntermediates pass against the whole first call of a Thunder-compiled model (CPU, gloo).
    A litgpt-style Llama with fake-FP8 linears (``thunder_fp8shard.testing.toy_models.FakeFP8Llama``, small widths)
    under FSDPTransform ZeRO-3 on 2 gloo ranks. On rank 0 we time the pass's two post-optimization hooks (forward and
    backward) and the whole first call (trace, autodiff, both hooks, compile, run) plus its backward; JSON to ``--out``.
    """
    from thunder_fp8shard.testing.harness import run_on_ranks

    rows = [run_on_ranks(measure, 2, n)[0] for n in args.layers]
    for a, b in zip(rows, rows[1:]):
        twice = b["n_layer"] == 2 * a["n_layer"]
        b["pass_time_ratio_vs_half_the_layers"] = b["pass_s"] / a["pass_s"] if twice else None
    machine = {"machine": platform.machine(), "processor": platform.processor(), "cpus": os.cpu_count(),
               "python": platform.python_version(), "note": "2 gloo ranks on this CPU machine; rank 0's figures"}
    with open(args.out, "w") as f:
        json.dump({"machine": machine, "rows": rows}, f, indent=2)
    for r in rows:
        print(json.dumps(r))


def main(argv=None) -> None:
    parser, add = subcommands(__doc__)
    p = add("ops", ops)
    p.add_argument("jsons", nargs="+", help="paired.py's comparison JSONs (<out>_<arm>.json)")
    p.add_argument("--top", type=int, default=8, help="operators a table (largest difference first)")
    p = add("cprofile", cprofile)
    p.add_argument("json")
    p.add_argument("--base", default="without")
    p.add_argument("--arm", default="default")
    p.add_argument("--top", type=int, default=30)
    p = add("compile", compile_cost)
    p.add_argument("--layers", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--out", default="benchmarks/results/pass_cost.json")
    a = parser.parse_args(argv)
    a.run(a)


if __name__ == "__main__":
    main()
