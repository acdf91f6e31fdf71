"""The job state machine's decisions, with an injected clock and no real worker."""

import pytest

from engine.config import JobSpec
from tpud.jobs import Job, State
from tpud.paths import Paths


class Loop:
    def watch(self, fileobj, callback): pass
    def unwatch(self, fileobj): pass
    def relay(self, output): pass


class Metrics:
    def __init__(self):
        self.restarts = []

    def restart(self, job, reason):
        self.restarts.append(reason)

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


@pytest.fixture
def make_job(tmp_path):
    now = [1000.0]

    def make(**restart):
        spec = JobSpec.model_validate({"name": "j", "restart": {"max_restarts": 3, "window_seconds": 100,
                                                                "backoff_initial_seconds": 2,
                                                                "backoff_max_seconds": 5, **restart}})
        job = Job(spec, tmp_path / "j.yaml", Paths.resolve(tmp_path), Loop(), Metrics(), stop_timeout=10,
                  clock=lambda: now[0])
        job.starts = 0

        def start():  # stands in for spawning a worker
            job.starts += 1
            job._set(State.STARTING)

        job.start = start
        return job

    return make, now


def test_crashes_back_off_exponentially_up_to_the_cap_then_fail(make_job):
    make, now = make_job
    job = make()
    delays = []
    for _ in range(3):
        job._exited(1)
        assert job.state is State.BACKOFF
        delays.append(job.backoff_until - now[0])
        now[0] = job.backoff_until
        job.tick()
        assert job.state is State.STARTING
    assert delays == [2, 4, 5]  # doubling, capped at backoff_max_seconds
    job._exited(137)
    assert job.state is State.FAILED and job.starts == 3
    assert job.metrics.restarts == ["crash", "crash", "crash"] and job.restarts_total == 3


def test_crashes_outside_the_window_do_not_count(make_job):
    make, now = make_job
    job = make()
    for _ in range(5):
        job._exited(1)
        now[0] += 101  # each crash falls out of the window before the next
        job.tick()
    assert job.state is State.STARTING and job.restarts_total == 5


def test_backoff_does_not_start_early(make_job):
    make, now = make_job
    job = make()
    job._exited(-9 + 256)
    now[0] = job.backoff_until - 0.01
    job.tick()
    assert job.state is State.BACKOFF and job.starts == 0


@pytest.mark.parametrize("status", [76, 78])
def test_bad_input_and_non_finite_loss_fail_without_restart(make_job, status):
    make, _ = make_job
    job = make()
    job._last_error_line = '{"event": "job cannot run here", "key": "attention.kernel"}'
    job._exited(status)
    assert job.state is State.FAILED and job.starts == 0 and "attention.kernel" in job.error


def test_exit_codes_with_and_without_a_stop_request(make_job):
    make, _ = make_job
    job = make()
    job._exited(0)
    assert job.state is State.SUCCEEDED
    job.stop_reason = "removed"
    job._exited(75)
    assert job.state is State.STOPPED
    job.stop_reason = None
    job._exited(75)  # stopped by someone else's SIGTERM: resume at once, not a crash
    assert job.state is State.STARTING and job.restarts_total == 0


def test_restart_counts_and_hold_survive_a_daemon_restart(make_job):
    make, _ = make_job
    job = make()
    job._exited(1)
    job.held = True
    job._save()
    again = make()
    assert again.restarts_total == 1 and again.held
    assert [h["to"] for h in again.history] == ["BACKOFF"]


def test_workers_never_inherit_the_service_managers_sockets(monkeypatch):
    from tpud.supervisor import worker_env

    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS"):
        monkeypatch.setenv(name, "x")
    monkeypatch.setenv("KEEP_ME", "1")
    env = worker_env("json")
    assert not {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS"} & env.keys()
    assert env["KEEP_ME"] == "1" and env["TPUD_LOG_FORMAT"] == "json" and env["PYTHONUNBUFFERED"] == "1"


def test_the_daemon_side_never_imports_torch():
    """DESIGN.md: the daemon process needs only the spec schema; a worker crash never reaches it."""
    import subprocess

    from tests.conftest import PYTHON, python_env

    code = ("import sys, tpud.cli, tpud.daemon, tpud.jobs, tpud.supervisor, tpud.channel, tpud.control, "
            "tpud.watcher, tpud.metrics, tpud.gcs, tpud.uploader, tpud.notify, engine.specfile, "
            "engine.checkpoint.manifest; assert 'torch' not in sys.modules, sorted(m for m in sys.modules "
            "if m.startswith('torch'))")
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, env=python_env())
    assert out.returncode == 0, out.stderr
