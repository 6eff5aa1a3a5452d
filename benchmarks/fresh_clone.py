"""The fresh-clone figures of README.md and docs/testing.md, measured: a clone of a commit runs ``make demo``,
``make test`` and ``make test-all`` as a new user would, and the generated regions get the quick start's output, the
test counts, the times, the environment's size, the commit and the machine.

    python benchmarks/fresh_clone.py                       # the environment made by make (needs PyPI)
    python benchmarks/fresh_clone.py --venv /path/to/.venv  # an existing one (its creation is not timed)

A region lies between ``<!-- figures:NAME begin -->`` and ``<!-- figures:NAME end -->``; the text around it is written
by hand. The machine's load average after each run is given with the times: other jobs on it lengthen them.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

from benchlib.reporting import fill_regions

ROOT = Path(__file__).resolve().parents[1]
PAGES = {"README.md": ("quickstart",), "docs/testing.md": ("suite",)}
SUMMARY = re.compile(r"^=* ?(?P<counts>(?:\d+ \w+(?:, )?)+) in (?P<seconds>[\d.]+)s", re.M)


def counts(output: str) -> dict[str, int | float]:
    """The last pytest summary line of ``output``: how many passed, skipped, ... and pytest's seconds."""
    m = list(SUMMARY.finditer(output))[-1]
    found = {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", m.group("counts"))}
    return {**found, "seconds": float(m.group("seconds"))}


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {round(seconds % 60)} s" if seconds >= 60 else f"{seconds:.0f} s"


def machine(py: str) -> str:
    """The CPU, its cores, and the environment's Python."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    version = subprocess.run([py, "-c", "import platform; print(platform.python_version())"], stdout=subprocess.PIPE,
                             text=True, check=True).stdout.strip()
    return f"{cpu}, {os.cpu_count()} cores, Python {version}"


LOADS: list[float] = []  # the 1-minute load average after each command


def timed(cmd: list[str], cwd: Path, env: dict) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seconds = time.perf_counter() - start
    LOADS.append(os.getloadavg()[0])
    if done.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-4000:]}")
    return seconds, done.stdout


def size_gb(path: Path) -> float:
    out = subprocess.run(["du", "-sbL", str(path)], stdout=subprocess.PIPE, text=True, check=True).stdout
    return int(out.split()[0]) / 1e9


def measure(rev: str, venv: str | None) -> dict[str, str]:
    """The regions' text, from a clone of ``rev`` in a temporary directory."""
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                         check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        clone = Path(tmp) / "clone"
        subprocess.run(["git", "clone", "-q", "--no-checkout", str(ROOT), str(clone)], check=True)
        subprocess.run(["git", "checkout", "-q", sha], cwd=clone, check=True)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        make = ["make"]
        if venv:  # the clone's own code first (an editable install elsewhere would be imported otherwise)
            os.symlink(venv, clone / ".venv")
            env["PYTHONPATH"] = str(clone)
            make += ["-o", ".venv/.installed"]
            setup = "existing (not timed)"
        else:
            setup = f"{minutes(timed(make + ['setup'], clone, env)[0])} (`make setup`)"
        py = str(clone / ".venv" / "bin" / "python")
        quick_s, quick = timed([py, "examples/quickstart.py"], clone, env)
        demo_s, _ = timed([py, "-m", "thunder_fp8shard.demo"], clone, env)
        fast_s, fast = timed(make + ["test"], clone, env)
        every_s, every = timed(make + ["test-all"], clone, env)
        site = next((clone / ".venv" / "lib").glob("python3*/site-packages"))
        total = size_gb(clone / ".venv")
        cuda = sum(size_gb(site / d) for d in ("nvidia", "triton") if (site / d).exists())
        loads = ", ".join(f"{x:.1f}" for x in LOADS)
        where = f"{date.today()}, commit {sha}, {machine(py)}; 1-minute load average after each run {loads}"
    fast, every = counts(fast), counts(every)
    tests = lambda c: f"{c['passed']} passed, {c.get('skipped', 0)} skipped, {c.get('warnings', 0)} warnings"  # noqa
    suite = "\n".join([
        f"{where}:", "",
        "| | result | wall |", "|---|---|---|",
        f"| environment | {total:.1f} GB, {cuda:.1f} GB of it CUDA libraries and Triton | {setup} |",
        f"| quick start, demo | exact | {minutes(quick_s)}, {minutes(demo_s)} |",
        f"| `make test` | {tests(fast)} | {minutes(fast_s)} |",
        f"| `make test-all` | {tests(every)} | {minutes(every_s)} |", ""])
    output = "\n".join(line for line in quick.splitlines() if line.strip())
    quickstart = f"```\n{output}\n```\n{minutes(quick_s)} at commit {sha} ([the machine](docs/testing.md)).\n"
    return {"quickstart": quickstart, "suite": suite}


def rewrite(text: str, regions: dict[str, str], names: tuple[str, ...], page: str) -> str:
    return fill_regions(text, "figures", regions, names, page)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rev", default="HEAD", help="the commit to clone (default HEAD; commit your changes first)")
    p.add_argument("--venv", help="an existing environment to use instead of make's (its path)")
    a = p.parse_args(argv)
    regions = measure(a.rev, a.venv and os.path.abspath(a.venv))
    for page, names in PAGES.items():
        (ROOT / page).write_text(rewrite((ROOT / page).read_text(), regions, names, page))
        print(f"wrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
