"""The torch-free contract (docs/architecture.md, "Layers"): the daemon never imports torch.

Every tpud module, and the engine modules the daemon reads (the spec, the worker's events,
checkpoint manifests, the state layout), import without torch: a crashed or hung worker can
then never take the daemon down, and the daemon starts in a fraction of a second. The worker
entry point imports torch only once it trains.
"""

import pkgutil
import subprocess

import tpud
from tests.conftest import PYTHON, python_env

ENGINE_SIDE = ["engine.spec.schema", "engine.spec.loader", "engine.events", "engine.checkpoint.manifest",
               "engine.layout", "engine.backoff", "engine.exit_codes", "engine.errors", "engine.hooks",
               "engine.requests", "engine.logs",
               # tpud prepare, and the dataset fetch before a worker starts
               "engine.data.prepare", "engine.data.pipeline", "engine.data.remote", "engine.data.manifest",
               "engine.data.dataset", "engine.hf.config", "engine.hf.remote"]


def daemon_modules() -> list[str]:
    tpud_modules = [m.name for m in pkgutil.walk_packages(tpud.__path__, "tpud.") if not m.name.endswith("__main__")]
    return ["tpud", *tpud_modules, *ENGINE_SIDE]


def test_the_daemon_side_never_imports_torch():
    modules = daemon_modules()
    assert {"tpud.daemon", "tpud.job.job", "tpud.worker.process", "tpud.jobfiles.watcher"} <= set(modules)
    code = (f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
            "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
            "assert not loaded, loaded")
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, env=python_env())
    assert out.returncode == 0, out.stderr
