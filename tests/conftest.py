from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

# Fixtures that start real servers: fake-gcs-server, Debian's Prometheus, our GCE metadata server.
pytest_plugins = ("tests.gcs_server", "tests.prometheus", "tests.metadata_server")

REPO = Path(__file__).resolve().parent.parent
TINY_JOB = REPO / "configs" / "jobs" / "tiny-cpu.yaml"


@pytest.fixture
def tiny_spec():
    """The demo job with overrides, as the engine sees it."""
    from engine.spec.loader import load_spec

    def make(*overrides: str):
        return load_spec(TINY_JOB, ["data.corpus_bytes=400000", *overrides])

    return make


def python_env(**extra: str) -> dict[str, str]:
    """Environment for child Python processes that must import this checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PJRT_", "CPU_NUM_DEVICES", "TPUD_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


PYTHON = sys.executable


@pytest.fixture(autouse=True)
def _no_memory_tier_left_behind():
    """Daemons keep a job's memory tier in /dev/shm (tpud.paths.Paths.memory) after it stops:
    the states of every test's homes would add up in RAM over a whole run."""
    shm = Path("/dev/shm")
    before = set(shm.glob("tpud-*")) if shm.is_dir() else set()
    yield
    for left in (set(shm.glob("tpud-*")) if shm.is_dir() else set()) - before:
        shutil.rmtree(left, ignore_errors=True)
