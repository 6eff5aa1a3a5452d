"""The package's layout: its modules import one another without a circle, the pass does not import its test support
(``thunder_fp8shard.testing``), the README's "How it works" names every file of the package and only those, and
comments and docstrings are a quarter of it at most."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).parents[1] / "thunder_fp8shard"  # this checkout's, whichever copy is installed


def _modules() -> dict[str, Path]:
    """Dotted name of every module of the package (a package by its ``__init__.py``) -> its file."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph() -> nx.DiGraph:
    """An edge from each module to every module of the package it imports: anywhere in the file (at the top, under
    ``TYPE_CHECKING``, inside a function), ``from a import b`` to ``a.b`` where that is a module, else to ``a``. A
    module's parent packages, which Python runs first, are not edges: every module would depend on the package's
    ``__init__``."""
    modules = _modules()
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                if target in modules and target != name:
                    graph.add_edge(name, target, line=f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    return graph


def test_the_graph_sees_every_kind_of_import():
    graph = import_graph()
    assert graph.has_edge("thunder_fp8shard.planning.grouping", "thunder_fp8shard.memory.model")  # at the top
    assert graph.has_edge("thunder_fp8shard.memory.resident", "thunder_fp8shard.analysis.program")  # TYPE_CHECKING
    assert graph.has_edge("thunder_fp8shard.transform", "thunder_fp8shard.reporting.plot")  # inside a function
    assert graph.has_edge("thunder_fp8shard.planning.planner", "thunder_fp8shard.planning.grouping")  # from the package import module
    assert graph.has_edge("thunder_fp8shard", "thunder_fp8shard.transform")  # from the __init__


def test_no_import_cycles():
    graph = import_graph()
    cycles = list(nx.simple_cycles(graph))
    described = [" -> ".join(f"{a} ({graph.edges[a, b]['line']})" for a, b in zip(c, [*c[1:], c[0]])) for c in cycles]
    assert not cycles, "import cycles in the package:\n" + "\n".join(described)


# the pass's layers, lowest first: a module imports only from its own layer and those below (issue #46: no arrow runs
# back up; analysis/ knows nothing of the memory model built on it)
LAYERS = (("plan", "format", "options"), ("analysis",), ("distributed", "memory"), ("planning",), ("runtime",),
          ("rewrite",), ("reporting",), ("pipeline",), ("transform",), ("", "demo", "testing"))


def _layer(module: str) -> int:
    part = module.split(".")[1] if "." in module else ""
    return next(i for i, names in enumerate(LAYERS) if part in names)


def test_no_import_runs_back_up_the_layers():
    graph = import_graph()
    up = [f"{a} -> {b} ({graph.edges[a, b]['line']})" for a, b in graph.edges if _layer(b) > _layer(a)]
    assert up == [], "imports from a higher layer:\n" + "\n".join(up)
    layer_of = {m: m.split(".")[1] for m in graph if m.count(".") >= 1}
    assert not any(layer_of.get(a) == "analysis" and layer_of.get(b) == "memory" for a, b in graph.edges)


def test_the_pass_does_not_import_its_test_support():
    graph = import_graph()
    support = {m for m in graph if m == "thunder_fp8shard.testing" or m.startswith("thunder_fp8shard.testing.")}
    users = {"thunder_fp8shard.demo", *support}
    reaching = {m for s in support for m in nx.ancestors(graph, s)} - users
    assert support and not reaching, f"modules of the pass that import thunder_fp8shard.testing: {sorted(reaching)}"


def test_the_architecture_page_names_every_file_of_the_package_and_only_those():
    """docs/architecture.md is the package's map (the README's "How it works" names the folders and links it)."""
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`(\w+\.py)`", page))  # bare file names (not tests/...)
    files = {p.name for p in PACKAGE.rglob("*.py")}
    subpackages = {f"{p.parent.name}/" for p in PACKAGE.glob("*/__init__.py")}
    assert files - named == set(), "files the architecture page does not name"
    assert named - files == set(), "files the architecture page names that do not exist"
    assert all(f"`{d}`" in page for d in subpackages)
    readme = (PACKAGE.parent / "README.md").read_text().split("## How it works\n", 1)[1].split("\n## ", 1)[0]
    assert "docs/architecture.md" in readme and all(f"`{d}`" in readme for d in subpackages - {"testing/"})


def test_the_transform_runs_the_stages_only_through_compile_plan():
    """transform.py is the pass's I/O with Thunder: the stages (analyze, agree and check, plan, rewrite) run in
    pipeline.compile_plan, which imports nothing of the transform."""
    graph = import_graph()
    stages = ("distributed.agreement", "planning", "rewrite")
    direct = [m for m in graph.successors("thunder_fp8shard.transform")
              if any(m == f"thunder_fp8shard.{s}" or m.startswith(f"thunder_fp8shard.{s}.") for s in stages)]
    assert direct == [] and graph.has_edge("thunder_fp8shard.transform", "thunder_fp8shard.pipeline")
    assert "thunder_fp8shard.transform" not in nx.descendants(graph, "thunder_fp8shard.pipeline")


def comment_share(root: Path = PACKAGE) -> float:
    """The share of the package's characters in comments and in the docstrings of its modules, classes and functions."""
    total = comments = 0
    for path in root.rglob("*.py"):
        source = path.read_text()
        total += len(source)
        comments += sum(len(tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                        if tok.type == tokenize.COMMENT)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                comments += len(ast.get_docstring(node, clean=False) or "")
    return comments / total


def test_comments_and_docstrings_are_at_most_a_quarter_of_the_package():
    # a docstring says what and why, once; figures live in benchmarks/results
    assert comment_share() <= 0.25, f"{comment_share():.1%}"


def test_every_rewrite_has_the_shape_and_the_plan_is_one_flat_record():
    """compile_plan runs each phase over pipeline.REWRITES in this order (issues #46, #56); a rewrite gives only the
    functions it has, none a no-op (a function returning one of its arguments unchanged). The plan is one flat record:
    no field is a section of others, and every name it answers is a field or a method of its own."""
    import ast
    import dataclasses
    import inspect
    import textwrap

    from thunder_fp8shard import pipeline
    from thunder_fp8shard.plan import ShardPlan
    from thunder_fp8shard.rewrite.shape import Rewrite

    assert [r.name for r in pipeline.REWRITES] == ["shard", "own_shards", "compaction", "forward_gather", "reschedule"]
    arity = {"sites": 1, "effect": 2, "decide": 1, "apply": 3, "variant": 1, "keep": 4, "count": 2}
    for r in pipeline.REWRITES:
        assert isinstance(r, Rewrite) and r._fields == ("name", *arity)
        for name, f in zip(r._fields[1:], r[1:]):
            if f is None:
                continue
            assert len(inspect.signature(f).parameters) == arity[name], (r.name, name)
            body = ast.parse(textwrap.dedent(inspect.getsource(f))).body[0].body
            body = [b for b in body if not (isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant))]
            params = set(inspect.signature(f).parameters)
            assert not (len(body) == 1 and isinstance(body[0], ast.Return) and isinstance(body[0].value, ast.Name)
                        and body[0].value.id in params), f"{r.name}.{name} is a no-op"
    plan = ShardPlan.of(2, "slice", "all", 1, buckets=[], peak_bytes_after=3, forward_gather=[])
    assert not any(dataclasses.is_dataclass(getattr(plan, f.name)) for f in dataclasses.fields(ShardPlan))
    assert plan.peak_bytes_after == 3 and plan.buckets == () and plan.forward_gather == ()
    generated = [n for n, v in vars(ShardPlan).items() if isinstance(v, property) and v.fget.__qualname__.startswith(
        "<lambda>")]
    assert not generated


def test_the_plan_is_built_once_and_only_the_run_report_corrects_it():
    """The rewrites decide the plan's fields; the pipeline assembles the plan once, after the rewrite (issue #56
    item 3). Only the run report makes a plan from a plan (its correction by what the audit measured)."""
    patching = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                      if ".replaced(" in p.read_text() and p.name != "plan.py")
    assert patching == ["runtime/run_report.py"], patching
