"""A real `tpud daemon --home TMP` supervising the tiny demo job (or no job), for the benchmarks
that measure the daemon beside a training job (or idle)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tpud.control import ControlClient  # noqa: E402

JOB = f"""\
name: bench
include: {REPO}/configs/jobs/tiny-cpu.yaml
train: {{max_steps: 1000000}}
checkpoint: {{interval_steps: 0}}
"""
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


@dataclass
class Supervised:
    home: Path
    process: subprocess.Popen
    client: ControlClient


@contextlib.contextmanager
def supervised_job(min_step: int = 10, timeout: float = 120.0) -> Iterator[Supervised]:
    """The daemon, once its job `bench` is RUNNING past `min_step`; stopped (SIGTERM) on exit."""
    def ready(jobs: list[dict]) -> bool:
        return bool(jobs) and jobs[0]["state"] == "RUNNING" and (jobs[0]["step"] or 0) > min_step

    with _daemon({"bench.yaml": JOB}, ready, timeout) as run:
        yield run


@contextlib.contextmanager
def idle_daemon(timeout: float = 60.0) -> Iterator[Supervised]:
    """A daemon without jobs, once it answers `status`; stopped (SIGTERM) on exit."""
    with _daemon({}, lambda jobs: True, timeout) as run:
        yield run


@contextlib.contextmanager
def _daemon(job_files: dict[str, str], ready, timeout: float) -> Iterator[Supervised]:
    home = Path(tempfile.mkdtemp(prefix="tpud-bench-"))
    (home / "jobs.d").mkdir()
    for name, text in job_files.items():
        (home / "jobs.d" / name).write_text(text)
    process = subprocess.Popen([sys.executable, "-m", "tpud", "daemon", "--home", str(home), "--metrics-addr",
                                "127.0.0.1:0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    try:
        client = ControlClient(home / "run" / "control.sock")
        deadline = time.monotonic() + timeout
        while True:
            try:
                if ready(client.call("status")["jobs"]):
                    break
            except Exception:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"the daemon was not ready within {timeout:.0f} s")
            time.sleep(0.5)
        yield Supervised(home, process, client)
    finally:
        process.terminate()
        process.wait(timeout=120)
