"""Where the pass's CPU goes, from paired JSONs (``paired.py --decompose-iters``): per JSON and arm, the net CPU ms a
step the pass adds on the timed operators (the arm's less the base's), the gross (its own operators alone), and the
operators that differ most, as markdown.

    python benchmarks/pass_cpu.py benchmarks/results/paired/paired_fp8_l8_n8_*.json [--top 8]
"""

from __future__ import annotations

import argparse
import json


def table(r: dict, top: int) -> str:
    """One comparison's ``pass_cpu`` as a heading line and a markdown table of its ``top`` operators."""
    p = r["pass_cpu"]
    kind = "null arm: the A/A check" if r.get("null") else "with the pass"
    wall = f" (wall {p['net_wall_ms_per_step']:+.3f})" if "net_wall_ms_per_step" in p else ""
    lines = [f"**{r['arm']}** vs {r['base']} ({kind}): net {p['net_ms_per_step']:+.3f} ms of CPU a step{wall}, gross "
             f"{p['gross_ms_per_step']:.3f} ms ({p['iterations']} iterations a side; "
             f"{r.get('sim_collectives') or 'real'} collectives)", "",
             "| operator | pass's | calls (arm / base) | ms a step (arm / base) | difference ms |", "|---|---|---|---|---|"]
    for o in p["by_operator"][:top]:
        lines.append(f"| `{o['operator']}` | {'yes' if o['pass'] else ''} | {o['arm_calls']:g} / "
                     f"{o['base_calls']:g} | {o['arm_ms']:.3f} / {o['base_ms']:.3f} | {o['diff_ms']:+.3f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("jsons", nargs="+", help="paired.py's comparison JSONs (<out>_<arm>.json)")
    p.add_argument("--top", type=int, default=8, help="operators a table (largest difference first)")
    a = p.parse_args(argv)
    for path in a.jsons:
        with open(path) as f:
            r = json.load(f)
        if r.get("kind") != "paired":
            continue
        print(f"## {path}\n")
        print((table(r, a.top) if r.get("pass_cpu") else "no pass_cpu (run with --decompose-iters K > 0)") + "\n")


if __name__ == "__main__":
    main()
