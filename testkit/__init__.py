"""What the tests and the benchmarks share: real stand-ins for the outside world (fake-gcs-server,
our GCE metadata server), hostile inputs, a test corpus, hooks that record a training run, an HLO
reader, and helpers that start daemons and workers. Not installed: both run from the checkout."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TINY_JOB = REPO / "configs" / "jobs" / "tiny-cpu.yaml"


def python_env(**extra: str) -> dict[str, str]:
    """Environment for child Python processes that must import this checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PJRT_", "CPU_NUM_DEVICES", "TPUD_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    # Two trainers sharing the 2 cores (a reference beside the run under test, a worker beside its
    # daemon's tests) each spin OpenMP's idle threads at every barrier: 8x slower steps with
    # libgomp's active wait, 1.5x with the passive one. Numerically the same.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.update(extra)
    return env


PYTHON = sys.executable
