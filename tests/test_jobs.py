"""The job state machine's decisions, with an injected clock and no real worker."""

import pytest

from engine.spec.schema import JobSpec
from tpud.job.job import Job, State
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
                                                                "backoff_max_seconds": 5, "standby": False,
                                                                **restart}})
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
    assert job.next_timer() == job.backoff_until
    now[0] = job.backoff_until - 0.01
    job.tick()
    assert job.state is State.BACKOFF and job.starts == 0


def test_bad_input_fails_without_restart_and_says_why(make_job):
    make, _ = make_job
    job = make()
    job.tail.extend(['{"event": "job cannot run here", "key": "attention.kernel", "level": "error"}', "bye"])
    job._exited(78)
    assert job.state is State.FAILED and job.starts == 0 and "attention.kernel" in job.error


def test_non_finite_loss_rolls_back_at_most_max_rollbacks_times(make_job):
    make, now = make_job
    job = make()
    job.spec = job.spec.model_copy(update={"health": job.spec.health.model_copy(update={"max_rollbacks": 2})})
    for attempt in (1, 2):
        job.nonfinite = {"event": "nonfinite", "step": 7, "loss": "nan", "policy": "rollback"}
        job._exited(76)
        assert job.state is State.BACKOFF and job.rollbacks == attempt
        job.tick()  # a rollback restarts at once
        assert job.state is State.STARTING and job.starts == attempt
    job.nonfinite = {"event": "nonfinite", "step": 9, "loss": "inf", "policy": "rollback"}
    job._exited(76)
    assert job.state is State.FAILED and "step 9" in job.error and "2 rollbacks spent" in job.error
    assert job.metrics.restarts == ["nonfinite", "nonfinite"]


def test_non_finite_loss_with_policy_stop_fails(make_job):
    make, _ = make_job
    job = make()
    job.nonfinite = {"event": "nonfinite", "step": 3, "loss": "nan", "policy": "stop"}
    job._exited(76)
    assert job.state is State.FAILED and job.starts == 0 and "non-finite loss (nan) at step 3" in job.error


def test_a_crash_is_classified_for_metrics_and_status(make_job):
    make, _ = make_job
    job = make()
    job.tail.extend(["Traceback (most recent call last):", '  File "train.py", line 9, in step',
                     "    boom()", "RuntimeError: injected crash after step 4"])
    job._exited(1)
    assert job.metrics.restarts == ["exception"] and job.state is State.BACKOFF
    assert job.error.startswith("RuntimeError: injected crash after step 4")
    job.tail.clear()  # as at the next spawn
    job._exited(128 + 11)
    assert job.metrics.restarts == ["exception", "signal"] and "SIGSEGV" in job.error


def test_the_restart_budget_fails_the_job_with_the_last_reason(make_job):
    make, now = make_job
    job = make(max_restarts=1)
    job._exited(139)
    now[0] = job.backoff_until
    job.tick()
    job._exited(139)
    assert job.state is State.FAILED
    assert "restart budget spent" in job.history[-1]["reason"] and "SIGSEGV" in job.history[-1]["reason"]


class Worker:
    """Stands in for a live worker: records signals."""

    def __init__(self, stopped=False):
        self.signals, self.stdout, self.pid, self.is_stopped = [], None, 4242, stopped

    def signal(self, signum):
        self.signals.append(signum)

    def stopped(self):
        return self.is_stopped


def running(job, now, step_time=0.5):
    job.worker = Worker()
    job._set(State.RUNNING)
    job.last_heard = now[0]
    job._on_message({"type": "event", "event": "started", "step": 0, "badput": {}})
    for step in range(1, 11):
        job._on_message({"type": "event", "event": "step", "step": step, "step_time_s": step_time, "badput": {}})


def test_a_silent_worker_is_hung_after_the_bound_then_terminated_and_killed(make_job):
    import signal

    make, now = make_job
    job = make()
    running(job, now, step_time=10.0)  # slow steps: the bound is 10 x the median, not the 60 s floor
    assert job.hang_bound() == 100.0
    assert job.next_timer() == now[0] + 100.0  # the daemon's loop wakes then, not at its next tick
    now[0] += 99
    job.tick()
    assert job.hang is None and job.worker.signals == []
    now[0] += 2
    job.tick()
    assert "no heartbeat for 101s" in job.hang and job.worker.signals == [signal.SIGTERM]
    assert job.next_timer() == job.kill_at == now[0] + job.spec.health.kill_grace_seconds
    now[0] += job.spec.health.kill_grace_seconds
    job.tick()
    assert job.worker.signals == [signal.SIGTERM, signal.SIGKILL]
    job.worker = None
    job._exited(137)
    assert job.state is State.BACKOFF and job.metrics.restarts == ["hang"] and job.error.startswith("hung")


def test_a_stopped_worker_is_killed_at_once_since_it_cannot_act_on_sigterm(make_job):
    import signal

    make, now = make_job
    job = make()
    running(job, now, step_time=10.0)
    job.worker.is_stopped = True  # SIGSTOP: SIGTERM would stay pending until a SIGCONT
    now[0] += 101
    job.tick()
    assert "no heartbeat for 101s" in job.hang and job.worker.signals == [signal.SIGKILL]
    assert job.kill_at is None


def test_startup_and_checkpoints_get_longer_allowances(make_job):
    make, now = make_job
    job = make()
    job.worker = Worker()
    health = job.spec.health
    assert job.hang_bound() == health.startup_timeout_seconds  # restoring and compiling
    job._on_message({"type": "event", "event": "started", "step": 40, "badput": {}})
    job._on_message({"type": "event", "event": "step", "step": 41, "step_time_s": 0.1, "badput": {}})
    assert job.hang_bound() == health.startup_timeout_seconds  # the first steps compile
    job._on_message({"type": "event", "event": "step", "step": 42, "step_time_s": 0.1, "badput": {}})
    assert job.hang_bound() == health.heartbeat_timeout_seconds
    job._on_message({"type": "event", "event": "checkpoint_started", "step": 42})
    assert job.hang_bound() == health.checkpoint_timeout_seconds
    job._on_message({"type": "event", "event": "checkpoint_committed", "step": 42, "path": "/x", "seconds": 4.0})
    assert job.hang_bound() == health.heartbeat_timeout_seconds
    job._on_message({"type": "event", "event": "checkpoint_started", "step": 43})
    job._on_message({"type": "heartbeat", "step": 43, "micro_step": 0})  # an async save: the loop runs on
    assert job.hang_bound() == health.heartbeat_timeout_seconds


def test_a_preemption_checkpoints_within_the_deadline_and_ends_preempted(make_job):
    make, now = make_job
    job = make()
    running(job, now)
    job.save_seconds = 4.0  # the last checkpoint took 4 s to write
    sent = []
    job._request = lambda action, deadline_s, fallback: sent.append((action, deadline_s))
    job.preempt(30.0)
    assert job.state is State.STOPPING and sent == [("checkpoint_and_exit", 30.0 - 6.0 - 1.0)]
    assert job.kill_at == now[0] + 30.0 + job.spec.health.kill_grace_seconds
    job.worker = None
    job._exited(75)
    assert job.state is State.PREEMPTED and job.starts == 0
    job.notice_cleared()  # the maintenance is over: run again
    assert job.state is State.STARTING and job.starts == 1


def test_a_preemption_keeps_a_waiting_job_from_starting(make_job):
    make, now = make_job
    job = make()
    job._exited(1)
    assert job.state is State.BACKOFF
    job.preempt(30.0)
    now[0] = job.backoff_until + 1
    job.tick()
    assert job.state is State.PREEMPTED and job.starts == 0


def test_goodput_is_in_status_and_survives_a_daemon_restart(make_job):
    make, now = make_job
    job = make()
    job.worker = Worker()
    job.ledger.enter("worker")
    now[0] += 3
    job._on_message({"type": "event", "event": "started", "step": 0, "badput": {"startup": 1.0, "restore": 0.5}})
    now[0] += 10
    job._on_message({"type": "event", "event": "step", "step": 10, "step_time_s": 1, "badput": {"checkpoint": 1.0}})
    snap = job.snapshot()["goodput"]
    assert snap["ratio"] == pytest.approx(9 / 13, abs=1e-4)
    assert snap["badput_seconds"]["startup"] == 2.5 and snap["badput_seconds"]["restore"] == 0.5
    job._save()
    assert make().ledger.productive == pytest.approx(9)


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
    from tpud.worker.process import worker_env

    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS"):
        monkeypatch.setenv(name, "x")
    monkeypatch.setenv("KEEP_ME", "1")
    env = worker_env("json")
    assert not {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS"} & env.keys()
    assert env["KEEP_ME"] == "1" and env["TPUD_LOG_FORMAT"] == "json" and env["PYTHONUNBUFFERED"] == "1"


def test_the_backoff_starts_over_once_a_worker_commits_a_checkpoint(make_job):
    make, now = make_job
    job = make()
    delays = []
    for committed in (False, True, False):
        job._exited(1)
        delays.append(job.backoff_until - now[0])
        now[0] = job.backoff_until
        job.tick()
        if committed:  # this worker made progress: its crash is not part of a loop
            job._on_message({"type": "event", "event": "checkpoint_committed", "step": 5, "path": "/c/step_5"})
    assert delays == [2, 4, 2]
    job._exited(1)
    assert job.state is State.FAILED  # the restart budget still counts every crash in the window


class Spare(Worker):
    """Stands in for a WorkerProcess, standby or not: records releases and discards."""

    made = []

    def __init__(self, spec, paths, log_format, extra_env=None, *, standby=False):
        super().__init__()
        self.standby, self.extra_env, self.released, self.discarded = standby, extra_env, False, False
        self.pid = 5000 + len(Spare.made)
        Spare.made.append(self)

    def release(self, spec):
        self.released = True
        return True

    def discard(self):
        self.discarded = True


def test_spares_start_beside_a_cold_worker_and_before_a_restart_and_go_with_the_spec(tmp_path, monkeypatch):
    import tpud.job.job

    monkeypatch.setattr(tpud.job.job, "WorkerProcess", Spare)
    Spare.made = []
    spec = JobSpec.model_validate({"name": "j", "restart": {"backoff_initial_seconds": 0}})
    job = Job(spec, tmp_path / "j.yaml", Paths.resolve(tmp_path), Loop(), Metrics(), stop_timeout=10)
    job.start()
    cold, spare = Spare.made
    assert job.worker is cold and not cold.standby and job.standbys == [spare] and spare.standby
    job._release()
    job._exited(137)  # a crash: the restart will take `spare`, whose successor starts now
    assert job.state is State.BACKOFF and len(job.standbys) == 2
    successor = job.standbys[1]
    job.tick()
    assert job.worker is spare and spare.released and job.standbys == [successor]
    job.replace_spec(spec.model_copy(update={"restart": spec.restart.model_copy(update={"max_restarts": 9})}),
                     tmp_path / "j.yaml")
    job._release()
    job._exited(75)  # checkpointed for the reload: the spare warmed up for the old spec goes
    assert successor.discarded and not job.worker.standby and job.standbys == [Spare.made[-1]]
    job.stop("stop")
    job._release()
    job._exited(75)
    assert job.state is State.STOPPED and Spare.made[-1].discarded and job.standbys == []
