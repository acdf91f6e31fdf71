"""The warm spare worker (restart.standby): imports first at the lowest priority, trains only
when released, and leaves nothing behind when discarded. Real processes throughout."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.helpers import committed, wait_until
from tpud.paths import Paths
from tpud.worker.process import WorkerProcess

pytestmark = pytest.mark.slow  # real worker processes importing torch


def nice_values(pid: int) -> list[int]:
    values = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            values.append(int((task / "stat").read_text().rsplit(")", 1)[1].split()[16]))
        except (OSError, IndexError, ValueError):
            continue  # the thread ended meanwhile
    return values


@pytest.fixture
def standby(tiny_spec, tmp_path):
    spec = tiny_spec("train.max_steps=3", "scheduler.warmup_steps=1", "checkpoint.interval_steps=3")
    paths = Paths.resolve(tmp_path)
    worker = WorkerProcess(spec, paths, "json", extra_env={"PYTHONPATH": str(REPO)}, standby=True)
    yield spec, paths, worker
    worker.discard()


def test_a_standby_warms_up_at_the_lowest_priority_and_trains_only_once_released(standby):
    spec, paths, worker = standby
    # The imports run on a thread at nice 19, so a spare never slows the worker it stands in for.
    wait_until(lambda: 19 in nice_values(worker.pid), "the warm-up thread at nice 19", timeout=60)
    time.sleep(1.0)
    assert worker.proc.poll() is None and committed(paths.layout.checkpoints(spec.name)) == []  # waiting, not training
    assert worker.release(spec)
    assert worker.proc.wait(timeout=120) == 0, worker.stdout.read().decode(errors="replace")[-3000:]
    assert committed(paths.layout.checkpoints(spec.name)) == [(3, 0)]


def test_a_released_standby_trains_at_normal_priority(standby, tiny_spec):
    spec, paths, worker = standby
    spec = tiny_spec("train.max_steps=200", "scheduler.warmup_steps=1", "checkpoint.interval_steps=0")
    wait_until(lambda: 19 in nice_values(worker.pid), "the warm-up thread at nice 19", timeout=60)
    assert worker.release(spec)  # mid-import: what is left of the imports speeds up too
    # Every thread is back at the worker's own priority (tpud runs as root; unprivileged, the
    # import-spawned threads would stay low, which the worker docs say).
    wait_until(lambda: worker.proc.poll() is None and (os.geteuid() != 0 or max(nice_values(worker.pid)) == 0)
               and len(nice_values(worker.pid)) > 1, "all threads at nice 0")
    worker.discard()


def test_a_discarded_standby_leaves_no_process_and_trains_nothing(standby):
    spec, paths, worker = standby
    pid = worker.pid
    worker.discard()
    assert worker.proc.returncode == -signal.SIGKILL
    assert not Path(f"/proc/{pid}").exists()
    assert committed(paths.layout.checkpoints(spec.name)) == []


def test_a_standby_whose_stdin_closes_exits_quietly(standby):
    spec, paths, worker = standby
    worker.proc.stdin.close()
    assert worker.proc.wait(timeout=60) == 0
    assert committed(paths.layout.checkpoints(spec.name)) == []
    assert not worker.release(spec)  # a spare that is gone cannot be released: the daemon spawns afresh


def test_a_reader_never_sees_a_half_written_spec(standby):
    """A released standby reads the spec while its successor's spawn writes the same file."""
    spec, paths, worker = standby
    texts, done = [], threading.Event()

    def read():
        while not done.is_set():
            texts.append(worker.spec_file.read_text())

    reader = threading.Thread(target=read)
    reader.start()
    for _ in range(300):
        worker.write_spec(spec)
    done.set()
    reader.join()
    assert texts and set(texts) == {worker.spec_file.read_text()}


def catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler for `signum` (/proc's SigCgt mask)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def test_a_worker_asked_to_stop_before_its_hooks_exist_stops_as_asked(standby):
    """SIGTERM while a worker starts (here: a spare waiting for its release, before the hooks
    that record signals exist) is recorded from the first instant, not fatal: once it runs, the
    worker stops as asked, exit 75, not killed by the signal's default (143)."""
    spec, paths, worker = standby
    wait_until(lambda: catches(worker.pid, signal.SIGTERM), "a SIGTERM handler from the start", timeout=60)
    worker.signal(signal.SIGTERM)
    assert worker.release(spec)
    assert worker.proc.wait(timeout=120) == 75, worker.stdout.read().decode(errors="replace")[-3000:]
    assert committed(paths.layout.checkpoints(spec.name)) == [(0, 0)]  # the stop's checkpoint: no step trained
