"""Where one arm's Python time a step differs from another's, from a paired JSON run with ``--cprofile K``.

Usage: ``python benchmarks/cprofile_diff.py run_default.json [--base without] [--arm default] [--top 30]`` prints the
functions whose own time a step differs most (calls and own ms a step in each arm, and the difference), and the
totals of own time.
"""

from __future__ import annotations

import argparse
import gzip
import json


def diff(profile: dict, base: str, arm: str) -> list[tuple[str, float, float, float, float]]:
    """``(function, base calls, arm calls, base own ms, arm own ms)`` for every function of either arm."""
    a, b = profile["arms"][base], profile["arms"][arm]
    rows = []
    for key in set(a) | set(b):
        ca, ta = (a.get(key) or [0, 0, 0])[:2]
        cb, tb = (b.get(key) or [0, 0, 0])[:2]
        rows.append((key, ca, cb, ta, tb))
    return sorted(rows, key=lambda r: -abs(r[4] - r[3]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json")
    p.add_argument("--base", default="without")
    p.add_argument("--arm", default="default")
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    with (gzip.open if args.json.endswith(".gz") else open)(args.json, "rt") as f:
        profile = json.load(f)["op_cpu"]["cprofile"]
    rows = diff(profile, args.base, args.arm)
    print(f"| function | calls {args.base} | calls {args.arm} | own ms {args.base} | own ms {args.arm} | diff |")
    print("|---|---|---|---|---|---|")
    for key, ca, cb, ta, tb in rows[: args.top]:
        print(f"| `{key}` | {ca:g} | {cb:g} | {ta:.3f} | {tb:.3f} | {tb - ta:+.3f} |")
    total = {n: sum(v[1] for v in profile["arms"][n].values()) for n in (args.base, args.arm)}
    print(f"\nown ms a step, the top functions kept: {args.base} {total[args.base]:.1f}, {args.arm} {total[args.arm]:.1f}")


if __name__ == "__main__":
    main()
