"""The daemon reads job files and tpud.yaml in a helper process (tpud/jobfiles/offloop.py), in order."""

from __future__ import annotations

import os
import queue
import time
from pathlib import Path

from tpud.daemon import Daemon
from tpud.jobfiles.offloop import OffLoop
from tpud.paths import Paths
from tests.conftest import TINY_JOB


# Reads run in the helper process: module-level, so that they can be pickled.
def echo(value):
    return value


def wait_for(path: str) -> str:
    while not os.path.exists(path):
        time.sleep(0.01)
    return "gate"


def fail():
    raise ValueError("a strange file")


def sleep_forever():
    time.sleep(3600)


def drain(posted: queue.SimpleQueue, count: int) -> None:
    for _ in range(count):
        posted.get(timeout=60)()


def test_reads_run_in_another_process_in_order_once_each_while_queued_and_survive_a_failing_one(tmp_path):
    posted: queue.SimpleQueue = queue.SimpleQueue()
    offloop, seen, gate = OffLoop(posted.put), [], tmp_path / "gate"
    offloop.submit("block", wait_for, lambda: (str(gate),), seen.append)  # the rest queue up behind it
    offloop.submit("a", echo, lambda: ("a1",), seen.append)
    offloop.submit("a", echo, lambda: ("a2",), seen.append)  # "a" is still queued: this one is dropped
    offloop.submit("boom", fail, lambda: (), seen.append)
    offloop.submit("pid", os.getpid, lambda: (), seen.append)
    gate.touch()
    drain(posted, 3)
    assert seen[:2] == ["gate", "a1"] and seen[2] != os.getpid()  # parsed outside the daemon's process
    offloop.close()
    offloop.submit("late", echo, lambda: ("late",), seen.append)
    time.sleep(0.2)
    assert posted.empty() and len(seen) == 3


def test_a_read_that_runs_away_is_killed_and_the_next_one_runs():
    posted: queue.SimpleQueue = queue.SimpleQueue()
    offloop, seen = OffLoop(posted.put, timeout=2.0), []
    offloop.submit("stuck", sleep_forever, lambda: (), seen.append)
    offloop.submit("next", echo, lambda: ("next",), seen.append)
    drain(posted, 1)
    assert seen == ["next"]
    assert offloop._thread.daemon  # the interpreter never waits for the reader at exit
    offloop.close()


def test_a_scan_asked_for_after_a_reload_uses_the_reloaded_settings(tmp_path):
    paths = Paths.resolve(tmp_path)
    paths.jobs_dir.mkdir(parents=True)
    (paths.jobs_dir / "drill.yaml").write_text(f"include: {TINY_JOB}\nname: drill\n"
                                               "debug: {inject: {crash_at_step: 3}}\n")
    daemon = Daemon(paths)
    posted: queue.SimpleQueue = queue.SimpleQueue()
    daemon.offloop, results = OffLoop(posted.put), []
    daemon.reconcile = results.append  # what the loop would reconcile, in order
    paths.config.mkdir(parents=True, exist_ok=True)
    (paths.config / "tpud.yaml").write_text("allow_fault_injection: true\n")
    daemon._reload()            # SIGHUP
    daemon._on_files_changed()  # a file event right behind it, before the loop took the new settings
    drain(posted, 2)
    assert daemon.settings.allow_fault_injection
    assert [files[Path(paths.jobs_dir / "drill.yaml")].error for files in results] == [None, None]
    daemon.offloop.close()
