"""The daemon reads job files and tpud.yaml in a helper process (tpud/jobfiles/offloop.py), in order,
and a reader that dies is started again at once and never holds up an exit."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import textwrap
import time
from pathlib import Path

from structlog.testing import capture_logs

from tpud.daemon import Daemon
from tpud.jobfiles.offloop import OffLoop
from tpud.paths import Paths
from tpud.children.respawn import BACKOFF
from tests.conftest import PYTHON, REPO, TINY_JOB, python_env
from testkit.helpers import children_of, exited, wait_until
from testkit.reads import echo, fail, sleep_forever, wait_for  # run in the helper process: a light module




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


def started_reader(posted: queue.SimpleQueue) -> tuple[OffLoop, list[int]]:
    """An OffLoop that has answered a read, and the processes it started for that (its helpers)."""
    before = set(children_of(os.getpid()))
    offloop, seen = OffLoop(posted.put), []
    offloop.submit("first", echo, lambda: ("first",), seen.append)
    drain(posted, 1)
    assert seen == ["first"]
    return offloop, sorted(set(children_of(os.getpid())) - before)


def test_a_reader_killed_while_idle_is_started_again_at_once_and_reads_go_on():
    posted: queue.SimpleQueue = queue.SimpleQueue()
    with capture_logs() as logs:
        offloop, helpers = started_reader(posted)
        try:
            for pid in helpers:
                os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            wait_until(lambda: any(r["event"] == "the job-file reader exited; starting it again" for r in logs),
                       "the death logged", timeout=20)
            noticed = time.monotonic() - killed
            seen: list = []
            offloop.submit("after", echo, lambda: ("after",), seen.append)
            drain(posted, 1)  # (a pool's next worker never got the lock its killed worker held)
            assert seen == ["after"]
        finally:
            offloop.close()
    died = next(r for r in logs if r["event"] == "the job-file reader exited; starting it again")
    assert died["pid"] in helpers and died["status"] == 128 + signal.SIGKILL and died["read"] is None
    # Its first death: started again once a second has passed since its start (BACKOFF.initial), not later.
    assert died["in_s"] <= BACKOFF.initial
    assert noticed < 10, noticed  # seen as it happened (the pidfd), not at the next read's timeout
    assert offloop.pid is None and all(map(exited, helpers))


def test_a_read_whose_reader_is_killed_under_it_runs_again_on_the_next_one(tmp_path):
    posted: queue.SimpleQueue = queue.SimpleQueue()
    offloop, helpers = started_reader(posted)
    try:
        seen, gate, started = [], tmp_path / "gate", tmp_path / "started"
        offloop.submit("block", wait_for, lambda: (str(gate), str(started)), seen.append)
        wait_until(started.exists, "the read under way", timeout=20)
        for pid in helpers:
            os.kill(pid, signal.SIGKILL)
        started.unlink()
        wait_until(started.exists, "the read started again", timeout=20)
        gate.touch()
        drain(posted, 1)
        assert seen == ["gate"]
    finally:
        offloop.close()


def test_close_ends_a_reader_stopped_mid_read_within_seconds(tmp_path):
    posted: queue.SimpleQueue = queue.SimpleQueue()
    offloop, helpers = started_reader(posted)
    started = tmp_path / "started"
    offloop.submit("block", wait_for, lambda: (str(tmp_path / "never"), str(started)), posted.put)
    wait_until(started.exists, "the read under way", timeout=20)
    for pid in helpers:
        os.kill(pid, signal.SIGSTOP)
    began = time.monotonic()
    offloop.close()
    assert time.monotonic() - began < 10
    assert all(map(exited, helpers)), "close() left its helper processes behind"


def test_a_process_whose_reader_was_killed_exits_at_once(tmp_path):
    """The daemon's exit: nothing (a pool's finalizer, a join) waits on a lock the dead reader held."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        import os, queue, signal, sys, time
        from testkit.helpers import children_of
        from tests.test_offloop import echo
        from tpud.jobfiles.offloop import OffLoop

        if __name__ == "__main__":
            posted = queue.SimpleQueue()
            offloop = OffLoop(posted.put, timeout=600)
            offloop.submit("first", echo, lambda: ("first",), print)
            posted.get(timeout=60)()
            for pid in children_of(os.getpid()):
                os.kill(pid, signal.SIGKILL)
            time.sleep(0.5)
            offloop.submit("second", echo, lambda: ("second",), print)
            offloop.close()
            print("closed", flush=True)
    """))
    proc = subprocess.Popen([PYTHON, str(script)], cwd=REPO, env=python_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"the process did not exit within 60 s of its reader's death:\n{out}") from None
    assert proc.returncode == 0 and "closed" in out, out
