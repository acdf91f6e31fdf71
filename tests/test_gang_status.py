"""`tpud status --gang`: a row per host of a gang job, shared through the job's GCS prefix, and the
hosts missing named from this host's worker's watch: three daemons on loopback, one SIGKILLed."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

from tests.conftest import PYTHON
from testkit.helpers import Daemon, free_port, job_text, python_env, wait_until
from tpud.gang.board import GangBoard, gang_rows, row_of

pytestmark = pytest.mark.slow


def status_gang(daemon: Daemon, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "tpud", "status", "--gang", *args, "--home", str(daemon.home)],
                          capture_output=True, text=True, env=python_env(), timeout=30)


def test_status_gang_shows_every_host_and_names_a_killed_one_missing_at_once(tmp_path, gcs_server):
    port = free_port()
    daemons = []
    try:
        for host in range(3):
            home = tmp_path / f"host{host}"
            (home / "jobs.d").mkdir(parents=True)
            (home / "tpud.yaml").write_text(f"gang: {{host_index: {host}, host_count: 3, coordinator: "
                                            f"'127.0.0.1:{port}'}}\n")
            (home / "jobs.d" / "g.yaml").write_text(job_text("g").replace(
                "checkpoint: {interval_steps: 0}", "checkpoint: {interval_steps: 0, remote: gs://tpud-test/ckpt}"))
            daemons.append(Daemon(home, env={**gcs_server.env(), "OMP_NUM_THREADS": "1"}))

        def rows(daemon):
            out = status_gang(daemon, "-o", "json")
            gangs = json.loads(out.stdout)["gangs"] if out.returncode == 0 and out.stdout else []
            return gangs[0]["rows"] if gangs else []

        def every_row_running() -> bool:
            found = rows(daemons[0])
            return len(found) == 3 and all(r.get("state") == "RUNNING" and (r.get("step") or 0) >= 1 for r in found)

        wait_until(every_row_running, "every host's row, running, on host 0", timeout=180, interval=1.0)
        table = status_gang(daemons[0]).stdout
        assert "g: 3 hosts, generation" in table and "gs://tpud-test/ckpt/g/hosts/" in table
        assert [line.split()[0] for line in table.splitlines()[2:5]] == ["0*", "1", "2"]

        daemons[2].proc.send_signal(signal.SIGKILL)  # the host is gone: its worker dies with its daemon
        killed = time.monotonic()
        def missing() -> set[int]:
            return {m["host"] for m in daemons[0].status()["g"]["gang"]["missing"]}

        wait_until(lambda: 2 in missing(), "host 0's worker seeing host 2 gone", timeout=30, interval=0.1)
        seen_after = time.monotonic() - killed
        # Host 1's worker restarts with the gang's next generation meanwhile: until it is seated again
        # host 0's worker waits for it too. Then host 2 alone is missing.
        wait_until(lambda: missing() == {2}, "host 1 back, host 2 alone missing", timeout=60, interval=0.2)
        asked = time.monotonic()
        out = status_gang(daemons[0])
        answered = time.monotonic() - asked
        assert out.returncode == 0 and "missing: 2 (" in out.stdout, out.stdout
        rows_shown = {line.split()[0]: line for line in out.stdout.splitlines()[2:5]}
        assert "missing (lost" in rows_shown["2"] and "missing" not in rows_shown["1"], out.stdout
        print(f"host 2 named missing {seen_after:.2f} s after its SIGKILL; tpud status --gang answered in "
              f"{answered:.3f} s")
        assert seen_after < 3.0 + 3.0  # the peer timeout (3 s), and a beat's interval and this poll's
        assert answered < 1.0, answered  # a process's start included
    finally:
        for daemon in daemons:
            if daemon.proc.poll() is None:
                daemon.proc.kill()
                daemon.proc.wait()


def test_a_board_shares_rows_and_a_silent_host_is_named(tmp_path, gcs_server):
    """The board alone, against the GCS server: rows go up when they change, come back for every
    host, and a row that stopped changing for longer than STALE_S names its host."""
    snapshot = {"name": "j", "state": "RUNNING", "step": 7, "max_steps": 10, "restarts": 1, "warnings": [],
                "error": None, "checkpoints": {"local": {"step": 5}, "gcs": None},
                "gang": {"host": 0, "hosts": 3, "generation": 2, "members": [0, 1, 2], "missing": []}}
    clock = [1000.0]
    boards = [GangBoard("gs://tpud-test/ckpt", "j", host, every_s=0.1, wall=lambda: clock[0]) for host in (0, 1)]
    for host, board in enumerate(boards):
        board.update(row_of({**snapshot, "step": 7 + host}, clock[0]))
        board.start()
    try:
        wait_until(lambda: set(boards[0].rows) == {0, 1}, "both rows on host 0")
        view = gang_rows(snapshot, boards[0], clock[0] + 5)
        assert [(r["host"], r.get("step"), r["missing"]) for r in view["rows"]] == [
            (0, 7, None), (1, 8, None), (2, None, "never seen")]
        assert view["rows"][1]["commits"] == {"local": 5, "gcs": None} and view["missing"] == [2]
        late = gang_rows(snapshot, boards[0], clock[0] + 1000)
        assert late["rows"][1]["missing"].startswith("no word for") and late["missing"] == [1, 2]
    finally:
        for board in boards:
            board.stop()
