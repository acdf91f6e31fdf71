"""The daemon's helper processes die under a running job (the OOM killer, a careless `kill`): each
death is seen and the helper started again within seconds, the job trains on, and SIGTERM still
ends the daemon within seconds. Real daemon, workers, helpers and signals."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from engine.checkpoint import manifest as mf
from testkit.gcs_server import free_port
from testkit.helpers import Daemon, children_by_kind, exited, job_text, wait_until

pytestmark = pytest.mark.slow

# Stall guards, several times what a loaded 2-core machine takes: the fault they guard against
# took 120 s to see a dead reader, and forever to exit after one.
NOTICED_S = 30  # a helper's death seen, and the helper started again
EXIT_S = 60     # SIGTERM to exit, the job's final checkpoint included
STOPPED_TO_EXIT_S = 10  # from "tpud stopped" (every job stopped) to the process's end


def helpers(daemon: Daemon) -> dict[str, list[int]]:
    return children_by_kind(daemon.proc.pid)


def kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def logged(daemon: Daemon, event: str, count: int) -> list[dict]:
    """Wait until the daemon has logged `event` `count` times; those records."""
    return wait_until(lambda: len(records := daemon.events(event)) >= count and records, f"{count} x {event!r}",
                      timeout=NOTICED_S)


def replaced(daemon: Daemon, kind: str, old: list[int]) -> list[int]:
    """Wait for a live `kind` child that is none of `old`."""
    return wait_until(lambda: [p for p in helpers(daemon).get(kind, []) if p not in old], f"a new {kind}",
                      timeout=NOTICED_S)


def dropped_file_is_read(daemon: Daemon, name: str) -> None:
    """A job file dropped now shows in status (INVALID: it starts nothing) within seconds."""
    (daemon.home / "jobs.d" / f"{name}.yaml").write_text(f"name: {name}\ntrain: [unclosed\n")
    daemon.wait_for(lambda j: j.get(name, {}).get("state") == "INVALID", f"{name}.yaml read", timeout=NOTICED_S)


def stops_within_seconds(daemon: Daemon, children: list[int]) -> None:
    """SIGTERM: the daemon exits soon after its jobs stopped, having ended `children` itself."""
    sent = time.time()
    daemon.proc.send_signal(signal.SIGTERM)
    try:
        status = daemon.proc.wait(timeout=EXIT_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the daemon did not exit within {EXIT_S}s of SIGTERM\n{daemon.tail()}") from None
    gone, stopped = time.time(), daemon.logged_at("tpud stopped", sent)
    assert status == 0 and stopped is not None, daemon.tail()
    assert gone - stopped < STOPPED_TO_EXIT_S
    assert [p for p in children if not exited(p)] == []  # (not left to their parent-death signal)


def test_each_helper_killed_under_a_running_job_is_started_again_and_sigterm_still_ends_the_daemon(tmp_path):
    jobs_dir = tmp_path / "jobs.d"
    jobs_dir.mkdir()
    (jobs_dir / "alpha.yaml").write_text(job_text("alpha"))
    daemon = Daemon(tmp_path)
    try:
        daemon.wait_for(lambda j: j.get("alpha", {}).get("state") == "RUNNING" and (j["alpha"]["step"] or 0) >= 2,
                        "alpha training")
        first = wait_until(lambda: (h := helpers(daemon)).get("forkserver") and h.get("worker") and h, "the workers")

        # The job-file reader (and whatever else runs beside the workers): started again at once,
        # so a file dropped now is read at once; the worker never notices.
        kill([p for kind, pids in first.items() if kind not in ("worker", "forkserver") for p in pids])
        dropped_file_is_read(daemon, "broken")
        died = logged(daemon, "the job-file reader exited; starting it again", 1)[-1]
        assert died["pid"] in first["reader"] and died["status"] == 128 + signal.SIGKILL
        replaced(daemon, "reader", first["reader"])
        assert sorted(first) == ["forkserver", "reader", "worker"], first  # (a pool brought a resource tracker)
        step = daemon.status()["alpha"]["step"]
        daemon.wait_for(lambda j: j["alpha"]["state"] == "RUNNING" and j["alpha"]["step"] > step, "alpha training on")
        assert daemon.status()["alpha"]["restarts"] == 0

        # The fork server: its workers die with it (as they would with the daemon); the job resumes
        # from its checkpoint in a worker that a new server forks.
        out = daemon.cli("checkpoint-now", "alpha")
        assert out.returncode == 0, out.stderr
        kill(first["forkserver"])
        died = logged(daemon, "the fork server is gone; workers start cold until it is back", 1)[-1]
        assert died["status"] == 128 + signal.SIGKILL
        daemon.wait_for(lambda j: j["alpha"]["restarts"] == 1 and j["alpha"]["state"] == "RUNNING", "alpha resumed")
        assert [r["status"] for r in daemon.events("worker exited")] == [128 + signal.SIGKILL]
        assert daemon.events("worker started")[-1]["forked"]
        replaced(daemon, "forkserver", first["forkserver"])

        # Every child at once (what issue 27 saw): all back, the job resumed.
        out = daemon.cli("checkpoint-now", "alpha")
        assert out.returncode == 0, out.stderr
        saved = max(s for s, _, _ in mf.committed_steps(tmp_path / "state" / "checkpoints" / "alpha"))
        before = helpers(daemon)
        for pids in before.values():
            kill(pids)
        daemon.wait_for(lambda j: j["alpha"]["restarts"] == 2 and j["alpha"]["state"] == "RUNNING", "alpha resumed")
        restored = [r for r in daemon.events("checkpoint restored") if r.get("job") == "alpha"]
        assert restored and restored[-1]["step"] >= saved
        dropped_file_is_read(daemon, "late")
        logged(daemon, "the job-file reader exited; starting it again", 2)
        replaced(daemon, "forkserver", before["forkserver"])

        stops_within_seconds(daemon, [p for pids in helpers(daemon).values() for p in pids])
    finally:
        if daemon.proc.poll() is None:
            daemon.proc.kill()
            daemon.proc.wait()


def test_a_killed_gang_coordinator_is_started_again_and_sigterm_still_ends_the_daemon(tmp_path):
    """Host 0 of a gang of 2 whose peer never comes: its daemon runs the coordinator too."""
    (tmp_path / "jobs.d").mkdir()
    (tmp_path / "jobs.d" / "g.yaml").write_text(job_text("g"))
    (tmp_path / "tpud.yaml").write_text(
        f"gang: {{host_index: 0, host_count: 2, coordinator: '127.0.0.1:{free_port()}'}}\n")
    daemon = Daemon(tmp_path)
    try:
        daemon.wait_for(lambda j: (j["g"]["gang"] or {}).get("present") == 1, "host 0 in the gang")
        first = wait_until(lambda: (h := helpers(daemon)).get("coordinator") and h, "the coordinator")

        kill(first["coordinator"])
        replaced(daemon, "coordinator", first["coordinator"])

        # Every child at once: the coordinator, the reader, the job's worker.
        before = helpers(daemon)
        for pids in before.values():
            kill(pids)
        dropped_file_is_read(daemon, "broken")
        replaced(daemon, "coordinator", before["coordinator"])
        replaced(daemon, "reader", before["reader"])
        died = logged(daemon, "the gang coordinator exited; starting it again", 2)
        assert [r["status"] for r in died] == [128 + signal.SIGKILL] * 2
        assert died[0]["in_s"] == 0 and died[0]["restarts"] == 1  # it had lived: at once
        logged(daemon, "the job-file reader exited; starting it again", 1)

        stops_within_seconds(daemon, [p for pids in helpers(daemon).values() for p in pids])
    finally:
        if daemon.proc.poll() is None:
            daemon.proc.kill()
            daemon.proc.wait()
