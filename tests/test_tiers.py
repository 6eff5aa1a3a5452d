"""``make test``'s fast tier (docs/testing.md): the in-process, simulated and notebook tests, and one multi-rank exactness
test a setup, marked ``setup_exactness("<setup>")``: Thunder FSDP ZeRO-3, ZeRO-2, Thunder DDP, FSDP2 under ThunderFX,
and ranks that compile their own shapes (``tests/test_rank_shapes.py``). ``make test-all`` (CI's) runs every test.
Read in process, from the marks of the test modules' functions and ``pytest.param`` cases."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
SETUPS = ["ddp", "fsdp2", "rank_shapes", "zero2", "zero3"]
FAST = "unit or simulated or notebook or setup_exactness"


def _marks(obj) -> list:
    marks = getattr(obj, "pytestmark", [])
    return [getattr(m, "mark", m) for m in (marks if isinstance(marks, list) else [marks])]


def marked_cases() -> list[dict]:
    """Every ``setup_exactness`` mark of the test modules: the test, its parameters (where a ``pytest.param`` carries
    the mark), the setup it names, and whether the test is multi-rank."""
    cases = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        if path.name == Path(__file__).name or "setup_exactness" not in path.read_text():
            continue
        module = importlib.import_module(path.stem)  # pytest's prepend import mode: tests/ is on sys.path
        for name, fn in vars(module).items():
            if not name.startswith("test_") or not callable(fn):
                continue
            marks = _marks(fn)
            multirank = any(m.name == "multirank" for m in [*_marks(module), *marks])
            where = dict(module=path.name, test=name, multirank=multirank)
            cases += [dict(where, params={}, setup=m.args[0]) for m in marks if m.name == "setup_exactness"]
            for m in marks:
                if m.name != "parametrize":
                    continue
                argnames, argvalues = m.args[0], m.args[1]
                argnames = [a.strip() for a in argnames.split(",")] if isinstance(argnames, str) else list(argnames)
                for value in argvalues:
                    for pm in (getattr(p, "mark", p) for p in getattr(value, "marks", ())):
                        if pm.name == "setup_exactness":
                            cases.append(dict(where, params=dict(zip(argnames, value.values)), setup=pm.args[0]))
    return cases


def test_the_fast_tier_has_one_multirank_exactness_test_a_setup():
    cases = marked_cases()
    assert sorted(c["setup"] for c in cases) == SETUPS, cases  # each setup once, and nothing else
    for c in cases:
        assert c["multirank"] and "exact" in c["test"], c
        assert c["params"].get("setup", c["setup"]) == c["setup"] or c["setup"] == "rank_shapes", c
    by_setup = {c["setup"]: c for c in cases}
    assert by_setup["rank_shapes"]["module"] == "test_rank_shapes.py"
    assert "fsdp2" in by_setup["fsdp2"]["test"]
    assert all(by_setup[s]["module"] == "test_exact_training.py" for s in ("zero3", "zero2", "ddp", "fsdp2"))


def _recipe(makefile: str, target: str) -> str:
    return re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", makefile, re.M).group(1)


def test_make_test_runs_the_fast_tier_and_make_test_all_and_ci_every_test():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(rf"^FAST := {FAST}$", makefile, re.M)
    assert _recipe(makefile, "test").strip() == '$(PYTEST) -m "$(FAST)"'
    assert _recipe(makefile, "test-all").strip() == "$(PYTEST)"  # no -m: every tier
    assert re.search(r"^PYTEST := .* tests --nbmake notebooks\b", makefile, re.M)
    assert "\nmake test-all\n" in (ROOT / ".ci" / "run").read_text()
