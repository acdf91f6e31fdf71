"""No import circles among the engine/ and tpud/ modules, and the shape issue 29 set.

A circle makes a module's names depend on which of the two was imported first, and it hides
the layering: a name both sides need belongs in a module below them. An import inside a
function or under TYPE_CHECKING still ties the two modules together, so every import counts.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "tpud")


def module_files() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules that module `name` (at `path`) imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import name` imports the module pkg.name where there is one, else pkg.
            found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                         for alias in node.names)
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imported(name, path, modules) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected component of more than one module, as one circle through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [circle_through(graph, component) for component in components]


def circle_through(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest path from the component's first module back to itself, inside the component."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & component):
                if nxt == start:
                    return paths[node] + [start]
                if nxt not in paths:
                    paths[nxt] = paths[node] + [nxt]
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"{sorted(component)} is not strongly connected")


def test_the_graph_sees_every_kind_of_import():
    graph = import_graph()
    assert "engine.spec.schema" in graph["engine.spec.loader"]  # from engine.spec.schema import ...
    assert "engine.checkpoint.manifest" in graph["tpud.job.commits"]  # from engine.checkpoint import manifest
    assert "engine.train" in graph["tpud.worker.entry"]  # an import inside a function
    assert "engine.events" in graph["tpud.worker.entry"]  # from engine import events


def test_relative_imports_resolve_against_the_package(tmp_path):
    source = tmp_path / "c.py"
    source.write_text("from . import d\nfrom .. import e\nfrom ..f import g\n")
    modules = {name: tmp_path / "x.py" for name in ("p.q.c", "p.q.d", "p.e", "p.f", "p")}
    assert imported("p.q.c", source, modules) == {"p.q.d", "p.e", "p.f"}


def test_circles_are_found_and_named():
    graph = {"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": set(), "e": {"f"}, "f": {"e"}}
    assert circles(graph) == [["a", "b", "c", "a"], ["e", "f", "e"]]


def test_there_are_no_import_circles():
    found = circles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" -> ".join(circle) for circle in found)


def test_the_job_class_and_the_checkpoint_modules_stay_small():
    """Issue 29's shape: Job keeps the state machine only (events go to their owners through
    tpud/job/routing.py), and the checkpointer's responsibilities stay in modules of their own."""
    tree = ast.parse((ROOT / "tpud/job/job.py").read_text())
    job = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Job")
    assert job.end_lineno - job.lineno + 1 <= 300, "the Job class grew past 300 lines: route the event to its owner"
    for path in sorted((ROOT / "engine/checkpoint").glob("*.py")):
        assert len(path.read_text().splitlines()) <= 400, f"{path.name} grew past 400 lines: split a responsibility out"


def test_benchmarks_import_the_shared_testkit_not_the_tests():
    """bench/ and tests/ share servers, recorders and helpers through testkit/: a benchmark that
    imported tests/ would run its conftest and tie the two together."""
    offenders = []
    for path in sorted((ROOT / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}: {name}" for name in names if name == "tests" or name.startswith("tests.")]
    assert not offenders, offenders


def test_no_function_is_longer_than_a_screen():
    """A function over 60 lines mixes phases: split it where they change (issue 43)."""
    long = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} "
                                f"({node.end_lineno - node.lineno + 1} lines)")
    assert not long, long
