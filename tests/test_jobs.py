"""The job state machine's decisions, driven through its public seams: worker events, exits and
timer ticks, with an injected clock and stand-in worker processes."""

import dataclasses
import signal
import socket

import pytest

from engine import events
from engine.spec.schema import JobSpec
from tpud.job import states
from tpud.job.job import Job, State
from tpud.paths import Paths
from tpud.worker import channel


class Loop:
    def watch(self, fileobj, callback): pass
    def unwatch(self, fileobj): pass
    def relay(self, output): pass
    def post(self, fn): fn()


class Metrics:
    def __init__(self):
        self.restarts = []

    def restart(self, job, reason):
        self.restarts.append(reason)

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


class FakeWorker:
    """Stands in for a WorkerProcess: records signals."""

    def __init__(self, made, spec, extra_env, forkserver):
        self.spec, self.extra_env, self.forkserver = spec, extra_env, forkserver
        self.signals, self.stdout, self.is_stopped = [], None, False
        self.pid = 5000 + len(made)
        self.forked = forkserver is not None

    def signal(self, signum):
        self.signals.append(signum)

    def stopped(self):
        return self.is_stopped


class Workers:
    """The job's spawn function: every worker it started, in order."""

    def __init__(self):
        self.made: list[FakeWorker] = []

    def __call__(self, spec, paths, log_format, extra_env=None, *, forkserver=None):
        worker = FakeWorker(self.made, spec, extra_env, forkserver)
        self.made.append(worker)
        return worker


def step(n, step_time=0.5, **badput):
    return events.Step(step=n, loss=2.0, grad_norm=1.0, lr=1e-3, tokens_per_s=100.0, step_time_s=step_time,
                       badput=events.Badput(**badput))


@pytest.fixture
def make_job(tmp_path):
    now = [1000.0]

    def make(restart=None, health=None, workers=None, metrics=None, checkpoint=None, forkserver=None, gang=None,
             train=None):
        spec = JobSpec.model_validate({
            "name": "j", "health": health or {}, "checkpoint": checkpoint or {}, "train": train or {},
            "restart": {"max_restarts": 3, "window_seconds": 100, "backoff_initial_seconds": 2,
                        "backoff_max_seconds": 5, "standby": False, **(restart or {})}})
        workers = workers or Workers()
        job = Job(spec, tmp_path / "j.yaml", Paths.resolve(tmp_path), Loop(), metrics or Metrics(), stop_timeout=10,
                  clock=lambda: now[0], spawn=workers, forkserver=forkserver, gang=gang)
        job.workers = workers  # for the test to look at
        return job

    return make, now


def crash(job, now, status=1):
    """The current worker (started if there is none) exits with `status`."""
    if job.worker is None:
        job.start()
    job.worker_exited(status)


def test_crashes_back_off_exponentially_up_to_the_cap_then_fail(make_job):
    make, now = make_job
    job = make()
    delays = []
    for _ in range(3):
        crash(job, now)
        assert job.state is State.BACKOFF and job.worker is None
        delays.append(job.backoff_until - now[0])
        now[0] = job.backoff_until
        job.tick()
        assert job.state is State.STARTING and job.worker is not None
    assert delays == [2, 4, 5]  # doubling, capped at backoff_max_seconds
    job.worker_exited(137)
    assert job.state is State.FAILED and len(job.workers.made) == 4
    assert job.metrics.restarts == ["crash", "crash", "crash"] and job.restarts.total == 3


def test_crashes_outside_the_window_do_not_count(make_job):
    make, now = make_job
    job = make()
    for _ in range(5):
        crash(job, now)
        now[0] += 101  # each crash falls out of the window before the next
        job.tick()
    assert job.state is State.STARTING and job.restarts.total == 5


def test_backoff_does_not_start_early(make_job):
    make, now = make_job
    job = make()
    crash(job, now, 128 + 9)
    assert job.next_timer() == job.backoff_until
    now[0] = job.backoff_until - 0.01
    job.tick()
    assert job.state is State.BACKOFF and len(job.workers.made) == 1


def test_bad_input_fails_without_restart_and_says_why(make_job):
    make, now = make_job
    job = make()
    job.start()
    job.current.output.tail.extend(['{"event": "job cannot run here", "key": "attention.kernel", "level": "error"}', "bye"])
    job.worker_exited(78)
    assert job.state is State.FAILED and len(job.workers.made) == 1 and "attention.kernel" in job.error


@pytest.mark.parametrize("where", ["jobs_dir", "remote_jobs"])
def test_a_watched_job_files_copies_that_differ_across_the_gang_are_waited_for_then_fail(make_job, where):
    """Under the daemon the hosts' copies change seconds apart (an operator copying the file host
    by host, remote_jobs' polls, a host paused through the edit), so their specs may differ for a
    while; `tpud run`'s operator is watching, and it fails at once."""
    from engine.events import Step
    from engine.spec.fingerprint import HOSTS_DIFFER

    make, now = make_job
    refusal = '{"event": "%s: train.max_steps: 5 on host 0, 7 on host 1", "level": "error"}' % HOSTS_DIFFER

    def refused(job):
        if job.worker is None:
            job.start()
        job.current.output.tail.append(refusal)
        job.worker_exited(78)

    run = make()
    refused(run)
    assert run.state is State.FAILED  # `tpud run`'s file, named on its command line
    job = make()
    job.file = getattr(job.paths, where) / "j.yaml"
    for _ in range(11):  # 2 minutes of tries, every 10 s
        refused(job)
        assert job.state is State.BACKOFF and "waiting for them to agree" in job.record.history[-1]["reason"]
        now[0] += 10
    job.start()  # the copies agree at last: the gang trains
    job.handle(Step(step=1, loss=2.0, grad_norm=1.0, lr=1e-3, tokens_per_s=1.0, step_time_s=0.1))
    now[0] += 3600  # hours later the copies differ again: waited for afresh
    job.worker_exited(77)  # the gang restarts (its daemon starts a worker at once)
    for _ in range(20):
        refused(job)
        if job.state is State.FAILED:
            break
        assert job.state is State.BACKOFF
        now[0] += 10
    assert job.state is State.FAILED and len(job.workers.made) == 26 and HOSTS_DIFFER in job.error


@pytest.mark.parametrize("line", [
    '{"event": "replica mismatch: this process\'s state is the odd one; quarantined", "level": "error"}',
    '{"event": "rank 0 is a straggler: its forwards over the last 20 steps took 1.62x the others\' median at step '
    '40 (factor 1.5); evicted", "level": "error"}'])
def test_a_quarantined_or_evicted_host_fails_there_with_the_reason_and_is_not_restarted(make_job, line):
    make, now = make_job
    job = make()
    job.start()
    job.current.output.tail.extend([line, '{"event": "checkpoint committed", "level": "info"}'])
    job.worker_exited(79)
    assert job.state is State.FAILED and len(job.workers.made) == 1
    assert ("quarantined" in job.error or "evicted" in job.error) and "exit 79" in job.record.history[-1]["reason"]
    now[0] += 3600
    job.tick()
    assert job.state is State.FAILED and len(job.workers.made) == 1


def nonfinite(step_n, loss, policy):
    return events.NonFinite(step=step_n, loss=loss, grad_norm=None, policy=policy)


def test_non_finite_loss_rolls_back_at_most_max_rollbacks_times(make_job):
    make, now = make_job
    job = make(health={"max_rollbacks": 2})
    job.start()
    for attempt in (1, 2):
        job.handle(nonfinite(7, float("nan"), "rollback"))
        job.worker_exited(76)
        assert job.state is State.BACKOFF and job.restarts.rollbacks == attempt
        job.tick()  # a rollback restarts at once
        assert job.state is State.STARTING and len(job.workers.made) == attempt + 1
    job.handle(nonfinite(9, float("inf"), "rollback"))
    job.worker_exited(76)
    assert job.state is State.FAILED and "step 9" in job.error and "2 rollbacks spent" in job.error
    assert job.metrics.restarts == ["nonfinite", "nonfinite"]


def test_non_finite_loss_with_policy_stop_fails(make_job):
    make, _ = make_job
    job = make()
    job.start()
    job.handle(nonfinite(3, float("nan"), "stop"))
    job.worker_exited(76)
    assert job.state is State.FAILED and len(job.workers.made) == 1
    assert "non-finite loss (nan) at step 3" in job.error


def test_a_crash_is_classified_for_metrics_and_status(make_job):
    make, now = make_job
    job = make()
    job.start()
    job.current.output.tail.extend(["Traceback (most recent call last):", '  File "train.py", line 9, in step',
                     "    boom()", "RuntimeError: injected crash after step 4"])
    job.worker_exited(1)
    assert job.metrics.restarts == ["exception"] and job.state is State.BACKOFF
    assert job.error.startswith("RuntimeError: injected crash after step 4")
    now[0] = job.backoff_until
    job.tick()  # the next worker's output starts afresh
    job.worker_exited(128 + 11)
    assert job.metrics.restarts == ["exception", "signal"] and "SIGSEGV" in job.error


def test_the_restart_budget_fails_the_job_with_the_last_reason(make_job):
    make, now = make_job
    job = make(restart={"max_restarts": 1})
    crash(job, now, 139)
    now[0] = job.backoff_until
    job.tick()
    job.worker_exited(139)
    assert job.state is State.FAILED
    assert "restart budget spent" in job.record.history[-1]["reason"] and "SIGSEGV" in job.record.history[-1]["reason"]


def running(job, step_time=0.5):
    job.start()
    job.handle(events.Started(step=0))
    for n in range(1, 11):
        job.handle(step(n, step_time))
    assert job.state is State.RUNNING


def test_a_silent_worker_is_hung_after_the_bound_then_terminated_and_killed(make_job):
    make, now = make_job
    job = make()
    running(job, step_time=10.0)  # slow steps: the bound is 10 x the median, not the 60 s floor
    worker = job.worker
    assert job.watch.bound() == 100.0
    assert job.next_timer() == now[0] + 100.0  # the daemon's loop wakes then, not at its next tick
    now[0] += 99
    job.tick()
    assert job.current.hang is None and worker.signals == []
    now[0] += 2
    job.tick()
    assert "no heartbeat for 101s" in job.current.hang and worker.signals == [signal.SIGTERM]
    assert job.next_timer() == job.current.kill_at == now[0] + job.spec.health.kill_grace_seconds
    now[0] += job.spec.health.kill_grace_seconds
    job.tick()
    assert worker.signals == [signal.SIGTERM, signal.SIGKILL]
    job.worker_exited(137)
    assert job.state is State.BACKOFF and job.metrics.restarts == ["hang"] and job.error.startswith("hung")


def test_a_stopped_worker_is_killed_at_once_since_it_cannot_act_on_sigterm(make_job):
    make, now = make_job
    job = make()
    running(job, step_time=10.0)
    job.worker.is_stopped = True  # SIGSTOP: SIGTERM would stay pending until a SIGCONT
    now[0] += 101
    job.tick()
    assert "no heartbeat for 101s" in job.current.hang and job.worker.signals == [signal.SIGKILL]
    assert job.current.kill_at is None


def test_startup_and_checkpoints_get_longer_allowances(make_job):
    make, now = make_job
    job = make()
    job.start()
    health = job.spec.health
    assert job.watch.bound() == health.startup_timeout_seconds  # restoring and compiling
    job.handle(events.Started(step=40))
    job.handle(step(41, 0.1))
    assert job.watch.bound() == health.startup_timeout_seconds  # the first steps compile
    job.handle(step(42, 0.1))
    assert job.watch.bound() == health.heartbeat_timeout_seconds
    job.handle(events.CheckpointStarted(42, 0, "interval"))
    assert job.watch.bound() == health.checkpoint_timeout_seconds
    job.handle(events.CheckpointCommitted(42, 0, "interval", "/x", seconds=4.0))
    assert job.watch.bound() == health.heartbeat_timeout_seconds
    job.handle(events.CheckpointStarted(43, 0, "interval"))
    job.handle(events.Heartbeat(43, 0))  # the loop runs on after all
    assert job.watch.bound() == health.heartbeat_timeout_seconds
    # An async save: a worker silent from the moment it staged one is hung as soon as any other.
    job.handle(events.CheckpointStarted(44, 0, "interval", waits=False))
    assert job.watch.bound() == health.heartbeat_timeout_seconds


def connect(job) -> channel.Connection:
    """A real channel between the job and a stand-in worker: the worker's end."""
    ours, theirs = socket.socketpair()
    job.current.links[0].connection = channel.Connection(ours)
    return channel.Connection(theirs)


def test_a_preemption_checkpoints_within_the_deadline_and_ends_preempted(make_job):
    make, now = make_job
    job = make()
    running(job)
    job.handle(events.CheckpointCommitted(10, 0, "interval", "/c/step_10", seconds=4.0))  # saves take 4 s
    worker_end = connect(job)
    job.preempt(30.0)
    assert job.state is State.STOPPING
    assert worker_end.receive() == [events.CheckpointRequest(events.Action.CHECKPOINT_AND_EXIT, 30.0 - 6.0 - 1.0)]
    assert job.current.kill_at == now[0] + 30.0 + job.spec.health.kill_grace_seconds
    job.worker_exited(75)
    assert job.state is State.PREEMPTED and len(job.workers.made) == 1
    job.notice_cleared()  # the maintenance is over: run again
    assert job.state is State.STARTING and len(job.workers.made) == 2


def test_without_a_channel_requests_fall_back_to_signals(make_job):
    make, _ = make_job
    job = make()
    running(job)
    job.checkpoint_now(deadline_s=None)
    job.stop("stop")
    assert job.worker.signals == [signal.SIGUSR1, signal.SIGTERM]


def test_a_preemption_keeps_a_waiting_job_from_starting(make_job):
    make, now = make_job
    job = make()
    crash(job, now)
    assert job.state is State.BACKOFF
    job.preempt(30.0)
    now[0] = job.backoff_until + 1
    job.tick()
    assert job.state is State.PREEMPTED and len(job.workers.made) == 1


def test_goodput_is_in_status_and_survives_a_daemon_restart(make_job):
    make, now = make_job
    job = make()
    job.start()
    now[0] += 3
    job.handle(events.Started(step=0, badput=events.Badput(startup=1.0, restore=0.5)))
    now[0] += 10
    job.handle(step(10, 1, checkpoint=1.0))
    snap = job.snapshot()["goodput"]
    assert snap["ratio"] == pytest.approx(9 / 13, abs=1e-4)
    assert snap["badput_seconds"]["startup"] == 2.5 and snap["badput_seconds"]["restore"] == 0.5
    job.save()
    assert make().ledger.productive == pytest.approx(9)


def test_exit_codes_with_and_without_a_stop_request(make_job):
    make, _ = make_job
    job = make()
    job.start()
    job.worker_exited(0)
    assert job.state is State.SUCCEEDED
    job.start()
    job.stop("removed")
    job.worker_exited(75)
    assert job.state is State.STOPPED
    job.start()
    job.worker_exited(75)  # stopped by someone else's SIGTERM: resume at once, not a crash
    assert job.state is State.STARTING and job.restarts.total == 0 and len(job.workers.made) == 4


def test_restart_counts_and_hold_survive_a_daemon_restart(make_job):
    make, now = make_job
    job = make()
    crash(job, now)
    job.held = True
    job.save()
    again = make()
    assert again.restarts.total == 1 and again.held
    assert [h["to"] for h in again.record.history] == ["STARTING", "BACKOFF"]


def test_a_damaged_job_record_starts_afresh(make_job, tmp_path):
    make, now = make_job
    record = Paths.resolve(tmp_path).job_dir("j") / "job.json"
    record.parent.mkdir(parents=True)
    for text in ("{not json", "[1, 2]", '{"restarts_total": "many", "held": true}', '{"history": 7}'):
        record.write_text(text)
        job = make()
        assert not job.held and job.record.history == []
        crash(job, now)  # counting on from the record works
        assert job.state is State.BACKOFF and job.restarts.total == 1
        assert make().restarts.total == 1  # and the next record is whole


def test_workers_never_inherit_the_service_managers_sockets(monkeypatch):
    from tpud.children.process import worker_env

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
        crash(job, now)
        delays.append(job.backoff_until - now[0])
        now[0] = job.backoff_until
        job.tick()
        if committed:  # this worker made progress: its crash is not part of a loop
            job.handle(events.CheckpointCommitted(5, 0, "interval", "/c/step_5"))
    assert delays == [2, 4, 2]
    job.worker_exited(1)
    assert job.state is State.FAILED  # the restart budget still counts every crash in the window


class FakeForkServer:
    """Stands in for the daemon's ForkServer: importing until the test says it is warm."""

    def __init__(self):
        self.warm, self.waiting = False, []

    def ready(self):
        return self.warm

    def when_ready(self, fn):
        self.waiting.append(fn)

    def imported(self):
        self.warm = True
        for fn in self.waiting:
            fn()


def test_a_start_waits_for_the_fork_servers_imports_then_forks(make_job):
    make, now = make_job
    server = FakeForkServer()
    job = make(restart={"standby": True}, forkserver=server)
    job.start()
    assert job.state is State.STARTING and job.worker is None and job.workers.made == []
    job.start()  # asked again meanwhile (a reload, a cleared notice): still one worker to come
    server.imported()
    assert [w.forkserver for w in job.workers.made] == [server] and job.worker is job.workers.made[0]
    job.worker_exited(137)
    now[0] += 10
    job.tick()  # the restart: forked at once
    assert len(job.workers.made) == 2 and job.workers.made[1].forked


def test_a_stop_while_the_fork_server_imports_starts_nothing(make_job):
    make, _ = make_job
    server = FakeForkServer()
    job = make(restart={"standby": True}, forkserver=server)
    job.start()
    job.stop("stop")
    server.imported()
    assert job.state is State.STOPPED and job.workers.made == []


def test_a_job_file_changed_while_the_start_waits_starts_with_the_new_spec(make_job):
    """The chaos campaign (seed 9): a job file copied in while a restarted daemon's start still waited
    left the job STOPPED for good, no error, nothing to start it again."""
    make, _ = make_job
    server = FakeForkServer()
    job = make(restart={"standby": True}, forkserver=server)
    job.start()
    edited = job.spec.model_copy(update={"optimizer": job.spec.optimizer.model_copy(update={"lr": 0.5})})
    job.replace_spec(edited, job.file)
    server.imported()
    assert job.state is State.STARTING and [w.spec.optimizer.lr for w in job.workers.made] == [0.5]
    # An operator's stop while the start waits is not undone by an edit that follows it.
    job.worker_exited(137)
    server.warm, server.waiting = False, []  # importing again (a restart of the fork server)
    job.start()
    job.held = True
    job.stop("stop")
    job.replace_spec(job.spec.model_copy(), job.file)
    server.imported()
    assert job.state is State.STOPPED and len(job.workers.made) == 1


def test_standby_false_starts_cold_without_the_fork_server(make_job):
    make, _ = make_job
    server = FakeForkServer()
    job = make(restart={"standby": False}, forkserver=server)
    job.start()
    assert job.state is State.STARTING and job.workers.made[0].forkserver is None and server.waiting == []


def test_every_event_a_worker_sends_goes_to_its_owners_and_every_owners_handler_is_routed(make_job):
    from tpud.job import routing

    make, _ = make_job
    job = make(checkpoint={"remote": "gs://bucket/ckpt"})  # every part present: the GCS tier too
    assert set(routing.ROUTES) == set(events.WORKER_EVENTS)
    parts = {"job": job, **vars(job)}
    for kind, owners in routing.ROUTES.items():
        assert owners, f"{kind.__name__} has no owner"
        for owner in owners:
            assert callable(getattr(parts[owner], routing.handler_name(kind), None)), (kind.__name__, owner)
    for owner, part in parts.items():  # a handler the table leaves out would never be called
        for kind in events.WORKER_EVENTS:
            if callable(getattr(type(part), routing.handler_name(kind), None)):
                assert owner in routing.ROUTES[kind], (kind.__name__, owner)


def test_an_event_a_worker_never_sends_is_ignored(make_job):
    make, _ = make_job
    job = make()
    running(job)
    job.handle(events.CheckpointRequest(events.Action.STOP))  # not something a worker sends
    assert job.state is State.RUNNING and job.snapshot()["step"] == 10


# --- the transition table ---


def test_every_transition_a_job_makes_is_in_the_table(make_job):
    """A walk through the lifecycle: each move is checked against states.TRANSITIONS as it happens."""
    make, now = make_job
    job = make()
    running(job)
    job.checkpoint_now(deadline_s=None)
    job.handle(events.CheckpointCommitted(10, 0, "request", "/c/step_10"))
    job.stop("reload")
    job.worker_exited(75)
    job.stop("preempted")
    job.worker_exited(75)
    job.start()
    job.worker_exited(0)
    seen = [(h["from"], h["to"]) for h in job.record.history]
    assert seen == [("PENDING", "STARTING"), ("STARTING", "RUNNING"), ("RUNNING", "CHECKPOINTING"),
                    ("CHECKPOINTING", "RUNNING"), ("RUNNING", "STOPPING"), ("STOPPING", "STARTING"),
                    ("STARTING", "STOPPING"), ("STOPPING", "PREEMPTED"), ("PREEMPTED", "STARTING"),
                    ("STARTING", "SUCCEEDED")]


def test_a_transition_outside_the_table_is_refused():
    with pytest.raises(states.InvalidTransition, match="STOPPED -> RUNNING"):
        states.check(State.STOPPED, State.RUNNING)
    with pytest.raises(states.InvalidTransition):
        states.check(State.PENDING, State.SUCCEEDED)
    assert set(states.TRANSITIONS) == set(State)
    for groups in (states.ACTIVE, states.ENDED, states.WAITING):
        assert groups <= set(State)


def test_a_validation_loss_reaches_status_and_metrics(make_job):
    from tpud.metrics.series import Metrics as RealMetrics

    make, now = make_job
    job = make(metrics=(metrics := RealMetrics()))
    running(job)
    job.handle(events.Eval(step=10, loss=1.25, perplexity=3.49, seconds=0.4))
    assert job.snapshot()["eval_loss"] == 1.25 and job.snapshot()["eval_step"] == 10
    assert b'tpud_job_eval_loss{job="j"} 1.25' in metrics.exposition()


def test_the_checkpoint_interval_metric_is_the_one_the_worker_applies(make_job):
    """The worker's schedule decides the interval (engine.checkpoint.schedule.local_interval_s) and
    sends it in the step event: the daemon publishes it, deriving nothing."""
    from tpud.metrics.series import Metrics as RealMetrics

    make, now = make_job
    metrics = RealMetrics()
    job = make(metrics=metrics)
    interval = lambda: metrics.registry.get_sample_value("tpud_job_checkpoint_interval_seconds", {"job": "j"})  # noqa: E731
    job.handle(step(1))
    assert interval() is None  # no interval set: no figure
    job.handle(dataclasses.replace(step(2), checkpoint_interval_s=20.0))
    assert interval() == 20.0
    job.handle(step(3))  # a worker of another version, without the field: the last figure stays
    assert interval() == 20.0


def test_a_checkpoint_committed_before_the_daemon_started_is_in_status_and_metrics_from_the_start(make_job, tmp_path):
    """Else a daemon restarted on a job whose saves then stall never raises TpudCheckpointOverdue."""
    from engine.checkpoint.manifest import Manifest, step_dir_name, write_manifest
    from tpud.metrics.series import Metrics as RealMetrics

    job_dir = Paths.resolve(tmp_path).layout.checkpoints("j", None)
    for step, at in ((40, 1_700_000_000.0), (80, 1_700_000_600.0)):
        (directory := job_dir / step_dir_name(step)).mkdir(parents=True)
        (directory / "state").write_bytes(b"x")
        write_manifest(directory, Manifest.describe(directory, job="j", step=step, micro_step=0, world_size=1,
                                                    spec_hash="h", version="v", reason="interval", created_unix=at))
    make, now = make_job
    job = make(metrics=(metrics := RealMetrics()))
    sample = lambda name: metrics.registry.get_sample_value(name, {"job": "j", "tier": "local"})  # noqa: E731
    assert sample("tpud_checkpoint_last_committed_step") == 80
    assert sample("tpud_checkpoint_last_committed_timestamp_seconds") == 1_700_000_600.0
    assert job.snapshot()["last_checkpoint"]["step"] == 80 and job.snapshot()["checkpoints"]["local"]["step"] == 80


def test_a_failed_upload_is_a_failing_gcs_tier_in_status_until_the_next_upload(make_job):
    from tpud.gcs.tier import Transfer

    make, _ = make_job
    job = make(checkpoint={"remote": "gs://bucket/ckpt"})
    report = job.tiers.uploader.on_result  # what the uploader's thread calls after each attempt
    report((20, 0), None)
    report((20, 0), None)
    assert job.snapshot()["checkpoint_failures"]["gcs"]["count"] == 2
    assert job.snapshot()["warnings"] == [
        "gcs checkpoint failed 2 times in a row, last at step 20 0s ago: upload failed; it is retried"]
    report((20, 0), Transfer("step_000000020", 1, 5, 0, 0.5))
    assert job.snapshot()["warnings"] == [] and job.snapshot()["checkpoints"]["gcs"]["step"] == 20


def test_a_worker_that_fails_after_its_final_checkpoint_is_not_restarted(make_job):
    """A worker that aborts in its teardown after committing max_steps has nothing left to train:
    restarting it would only wait for a gang whose other hosts are done."""
    make, now = make_job
    job = make()
    job.start()
    job.handle(events.CheckpointCommitted(job.spec.train.max_steps - 1, 0, "interval", "/c/a"))
    job.worker_exited(134)  # before the final step: a crash like any other
    assert job.state is State.BACKOFF
    now[0] = job.backoff_until
    job.tick()
    job.handle(events.CheckpointCommitted(job.spec.train.max_steps, 0, "final", "/c/b"))
    job.worker_exited(134)
    assert job.state is State.SUCCEEDED and "(then exit 134)" in job.record.history[-1]["reason"]


@pytest.mark.parametrize("newest", ["final", "interval", "newer", "truncated"])
def test_a_gang_host_back_after_its_gang_finished_succeeds_without_waiting_for_it(make_job, tmp_path, newest):
    """A host lost near the end and back after the others' SUCCEEDED (its start brought the gang's
    final save from GCS): its worker would wait for a gang that never forms again. Only the final
    save at max_steps says so: after an edit of max_steps below the gang's step, or with an interval
    save at it, every host starts its worker and the gang saves its final step together."""
    from engine.checkpoint.manifest import Manifest, step_dir_name, write_global, write_manifest
    from tpud.gang.discovery import GangPlace

    step_n = 20 if newest == "newer" else 12
    directory = Paths.resolve(tmp_path).layout.checkpoints("j", None) / step_dir_name(step_n)
    directory.mkdir(parents=True)
    (directory / "state").write_bytes(b"x")
    manifest = Manifest.describe(directory, job="j", step=step_n, micro_step=0, world_size=1, spec_hash="h",
                                 version="v", reason="interval" if newest == "interval" else "final", host=1, hosts=2)
    write_manifest(directory, manifest)
    write_global(directory, manifest)
    if newest == "truncated":  # a damaged final save: the worker's restore deals with it
        (directory / "state").write_bytes(b"")
    make, _ = make_job
    job = make(gang=GangPlace(host=1, hosts=2, coordinator="127.0.0.1:1"), train={"max_steps": 12})
    job.start()
    if newest == "final":
        assert job.state is State.SUCCEEDED and job.workers.made == []
        assert "final step" in job.record.history[-1]["reason"]
    else:
        assert job.state is State.STARTING and len(job.workers.made) == 1
