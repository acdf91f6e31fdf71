"""The torch-free contract (docs/architecture.md, "Layers"): the daemon never imports torch.

Every tpud module, and the engine modules the daemon reads (the spec, the worker's events,
checkpoint manifests, the state layout), import without torch: a crashed or hung worker can
then never take the daemon down, and the daemon starts in a fraction of a second. The worker
entry point imports torch only once it trains.
"""

import pkgutil
import subprocess

import tpud
from testkit import PYTHON, python_env

ENGINE_SIDE = ["engine.spec.schema", "engine.spec.loader", "engine.events", "engine.checkpoint.manifest",
               "engine.layout", "engine.backoff", "engine.exit_codes", "engine.errors", "engine.hooks",
               "engine.requests", "engine.logs",
               # tpud prepare, and the dataset fetch before a worker starts
               "engine.prepare.command", "engine.prepare.pipeline", "engine.data.remote", "engine.data.manifest",
               "engine.data.dataset", "engine.hf.config", "engine.hf.remote"]


def daemon_modules() -> list[str]:
    tpud_modules = [m.name for m in pkgutil.walk_packages(tpud.__path__, "tpud.") if not m.name.endswith("__main__")]
    return ["tpud", *tpud_modules, *ENGINE_SIDE]


def test_the_daemon_side_never_imports_torch():
    modules = daemon_modules()
    assert {"tpud.daemon", "tpud.job.job", "tpud.children.process", "tpud.jobfiles.watcher"} <= set(modules)
    code = (f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
            "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
            "assert not loaded, loaded")
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, env=python_env())
    assert out.returncode == 0, out.stderr


# Where torch may run in tpud: the torch processes (the worker, the fork server, the coordinator),
# and the two commands that train or convert a model in the operator's own process.
TORCH_PLACES = ("tpud/worker/", "tpud/commands/export.py", "tpud/commands/profile.py")


def test_torch_runs_only_in_the_torch_processes_packages():
    """Not only at import: a tpud module's import inside a function counts, as does one of an
    engine module that imports torch when imported (itself, or through another such module)."""
    import ast
    from pathlib import Path

    root = Path(tpud.__file__).resolve().parent.parent

    def imports(path: Path, anywhere: bool = True) -> set[str]:
        """The modules the file imports (anywhere, or only when it is imported), but for type
        annotations' (TYPE_CHECKING)."""
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
                node.body = []
            if not anywhere and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                node.body = []
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.update([node.module, *(f"{node.module}.{alias.name}" for alias in node.names)])
        return found

    def name_of(path: Path) -> str:
        parts = path.relative_to(root).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    engine = {name_of(p): imports(p, anywhere=False) for p in (root / "engine").rglob("*.py")}
    torchy = {m for m, found in engine.items() if any(f == "torch" or f.startswith("torch.") for f in found)}
    while grown := {m for m, found in engine.items() if m not in torchy and found & torchy}:
        torchy |= grown
    assert "engine.train" in torchy and "engine.spec.loader" not in torchy
    where = {}
    for path in (root / "tpud").rglob("*.py"):
        found = imports(path)
        if any(f == "torch" or f.startswith("torch.") for f in found) or found & torchy:
            where[str(path.relative_to(root))] = sorted(f for f in found if f.startswith("torch") or f in torchy)
    assert "tpud/worker/entry.py" in where and "tpud/worker/gang/coordinator.py" in where
    stray = {path: modules for path, modules in where.items() if not path.startswith(TORCH_PLACES)}
    assert not stray, f"torch outside {TORCH_PLACES}: {stray}"
