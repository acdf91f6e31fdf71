"""The daemon reads job files and tpud.yaml off its loop (tpud/offloop.py), in order."""

from __future__ import annotations

import queue
import threading

from tpud.daemon import Daemon
from tpud.offloop import OffLoop
from tpud.paths import Paths
from tests.conftest import TINY_JOB


def drain(posted: queue.SimpleQueue, count: int) -> None:
    for _ in range(count):
        posted.get(timeout=30)()


def test_reads_run_in_order_once_each_while_queued_and_survive_a_failing_one():
    posted: queue.SimpleQueue = queue.SimpleQueue()
    offloop, seen, gate = OffLoop(posted.put), [], threading.Event()
    offloop.submit("block", gate.wait, seen.append)  # holds the thread while the rest queue up
    offloop.submit("a", lambda: "a1", seen.append)
    offloop.submit("a", lambda: "a2", seen.append)  # "a" is still queued: this one is dropped
    offloop.submit("boom", lambda: 1 / 0, seen.append)
    offloop.submit("b", lambda: "b", seen.append)
    gate.set()
    drain(posted, 3)
    assert seen == [True, "a1", "b"]
    offloop.close()
    offloop.submit("late", lambda: "late", seen.append)
    assert posted.empty() and seen == [True, "a1", "b"]


def test_a_stuck_read_never_holds_up_the_daemons_exit():
    offloop = OffLoop(lambda fn: None)
    offloop.submit("stuck", threading.Event().wait, print)  # never returns
    offloop.close()
    assert offloop._thread.daemon  # the interpreter does not join it at exit


def test_a_scan_asked_for_after_a_reload_uses_the_reloaded_settings(tmp_path):
    paths = Paths.resolve(tmp_path)
    paths.jobs_dir.mkdir(parents=True)
    (paths.jobs_dir / "drill.yaml").write_text(f"include: {TINY_JOB}\nname: drill\ndebug: {{inject: {{crash_at_step: 3}}}}\n")
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
    assert [files[paths.jobs_dir / "drill.yaml"].error for files in results] == [None, None]
    daemon.offloop.close()
