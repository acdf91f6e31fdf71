from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

# Fixtures that start real servers: fake-gcs-server, Debian's Prometheus, our GCE metadata server.
pytest_plugins = ("testkit.gcs_server", "tests.prometheus", "testkit.metadata_server")

from testkit import PYTHON, REPO, TINY_JOB, python_env  # noqa: F401  (tests import them from here too)


def tiny(*overrides: str):
    """The demo job with overrides, as the engine sees it (for module-scoped fixtures too)."""
    from engine.spec.loader import load_spec

    return load_spec(TINY_JOB, ["data.corpus_bytes=400000", *overrides])


@pytest.fixture
def tiny_spec():
    return tiny


@pytest.fixture
def memory(tmp_path):
    """The memory tier's root for an in-process Trainer (its `runtime` fixture); the tiny job's directory in it."""
    return tmp_path / "shm" / "tiny-cpu"


@pytest.fixture
def runtime(memory):
    """What a supervisor would tell an in-process Trainer: the memory tier's root (engine.runtime)."""
    from engine.runtime import Runtime

    return Runtime(memory_dir=memory.parent)




def drop_memory_tiers(root: Path, depth: int = 4) -> None:
    """Daemons keep a job's memory tier in /dev/shm (tpud.paths.Paths.memory) after it stops:
    drop those of the homes (directories with a run/) under `root`, else the states of every
    test's homes would add up in RAM over a whole run. Only these homes': a pytest run beside
    this one (tests/run_all.sh) has live tiers of its own there."""
    from tpud.paths import Paths

    for level in range(depth):
        for runtime in root.glob("/".join(["*"] * level + ["run"])):
            tier = Paths(config=runtime.parent, state=runtime.parent / "state", runtime=runtime).memory
            if tier.parent == Path("/dev/shm"):  # a tmpfs runtime keeps it inside, gone with the directory
                shutil.rmtree(tier, ignore_errors=True)


@pytest.fixture(autouse=True)
def _no_memory_tier_left_behind(request):
    yield
    if (tmp := request.node.funcargs.get("tmp_path")) is not None:
        drop_memory_tiers(tmp)


@pytest.fixture(autouse=True, scope="session")
def _no_memory_tier_left_behind_by_module_fixtures(tmp_path_factory):
    yield
    drop_memory_tiers(tmp_path_factory.getbasetemp(), depth=5)


# run_all.sh runs the end-to-end tests in two lanes side by side (TPUD_TEST_LANE=a|b), split by
# module to about equal times; a module not named here runs in lane b.
LANE_A = {"test_multihost.py", "test_distributed.py", "test_faults.py", "test_full_disk.py",
          "test_hostile_files.py", "test_without_xla.py", "test_nonfinite.py", "test_hf_export.py",
          "test_metrics.py", "test_gcs.py", "test_hf_import.py", "test_profile.py", "test_prepare.py",
          "test_replicas.py", "test_stragglers.py", "test_chaos.py"}


def pytest_collection_modifyitems(config, items):
    lane = os.environ.get("TPUD_TEST_LANE")
    if lane not in ("a", "b"):
        return
    keep = [item for item in items if (item.path.name in LANE_A) == (lane == "a")]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep
