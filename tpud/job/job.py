"""One job under supervision: an explicit state machine around its worker process.

The states and the transitions allowed between them are in states.py. Everything here runs on
the daemon's main loop thread: the loop hands a job its worker's output, channel events, exit
status and timer ticks, and the job decides. The worker's exit code says what happened
(engine/exit_codes.py, docs/architecture.md). What the job owns but does not decide lives beside it:
the restart budget and backoff, the hang bound and crash reasons (health/), the record that survives a daemon restart (record.py), goodput (goodput.py),
what a worker needs from GCS before it starts (inputs.py), the current worker's process
(current.py), what it reported (report.py), the gang (gang.py), its checkpoints (checkpoints.py), wandb
(tpud/tracking.py) and the GCS tier (tpud/gcs/tiers.py). Each worker event goes to
the parts that own it (routing.py); the job hears only those that can change its state.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Protocol

import structlog

from engine import events, exit_codes, fitting
from engine.requests import Action, Request
from engine.spec.schema import JobSpec
from tpud.gcs.tiers import CheckpointTiers
from tpud.job import goodput, inputs, routing, snapshot, states
from tpud.gang.discovery import GangPlace
from tpud.job.commits import JobCheckpoints
from tpud.job.current import CurrentWorker
from tpud.job.gang import GangView
from tpud.job.health import crashes
from tpud.job.health.hang import HangWatch
from tpud.job.record import JobRecord
from tpud.job.report import WorkerReport
from tpud.job.health.restarts import Restarts
from tpud.job.memory import JobMemory, MemoryBudget
from tpud.job.states import ACTIVE, ENDED, TRAINING, WAITING, State
from tpud.paths import Paths
from tpud.tracking import JobTracker
from tpud.worker.forkserver import ForkServer
from tpud.children import ranks
from tpud.children.process import WorkerProcess

log = structlog.get_logger()

# Where the goodput ledger books the time a job spends in a state without a worker.
_LEDGER_PHASE = {State.BACKOFF: goodput.BACKOFF, State.PREEMPTED: goodput.DOWN}
# tpud_job_restarts_total{reason}, each created at 0: a crash's reasons, and the supervisor's own.
RESTART_REASONS = (*crashes.REASONS, "hang", "nonfinite", "peer", "refit")
SAVE_EVERY_S = 10.0  # job.json between state changes, for the goodput ledger


class Loop(Protocol):
    """What a job needs from the daemon's event loop."""

    def watch(self, fileobj, callback) -> None: ...
    def unwatch(self, fileobj) -> None: ...
    def relay(self, output: bytes) -> None: ...
    def post(self, fn) -> None: ...  # run fn on the loop thread, from any thread


class MetricsSink(Protocol):
    def job_state(self, job: str, state: str) -> None: ...
    def job_progress(self, job: str, **values) -> None: ...
    def heartbeat(self, job: str, at: float) -> None: ...
    def restart(self, job: str, reason: str) -> None: ...
    def job_series(self, job: str, *, tiers: Iterable[str], restart_reasons: Iterable[str]) -> None: ...
    def checkpoint(self, job: str, *, tier: str, reason: str, seconds: float, bytes: int, step: int) -> None: ...
    def checkpoint_found(self, job: str, *, tier: str, step: int, at: float) -> None: ...
    def checkpoint_interval(self, job: str, seconds: float) -> None: ...
    def checkpoint_policy(self, job: str, intervals: dict[str, dict]) -> None: ...
    def experts(self, job: str, **values: float | None) -> None: ...
    def useful_mfu(self, job: str, ratio: float) -> None: ...
    def checkpoint_failure(self, job: str, tier: str) -> None: ...
    def goodput(self, job: str, ratio: float) -> None: ...
    def badput(self, job: str, kind: str, seconds: float) -> None: ...


Spawn = Callable[..., WorkerProcess]  # (spec, paths, log_format, extra_env, *, forkserver) -> a started worker


class Job:
    def __init__(self, spec: JobSpec, file: Path, paths: Paths, loop: Loop, metrics: MetricsSink,
                 *, stop_timeout: float, log_format: str = "json", clock=time.monotonic,
                 spawn: Spawn = WorkerProcess, gang: GangPlace | None = None,
                 memory_budget: MemoryBudget | None = None, forkserver: ForkServer | None = None):
        self.spec, self.file, self.paths, self.loop, self.metrics = spec, file, paths, loop, metrics
        self.clock, self.stop_timeout, self.name, self._saved_at = clock, stop_timeout, spec.name, clock()
        self.state = State.PENDING
        self.digest: str | None = None  # of the job file this spec came from
        self.error, self.error_detail = None, []  # what failed, and a crash's traceback lines
        self.report = WorkerReport(self.name, metrics, clock, paths.layout.skips_file(spec.name),
                                   paths.layout.job_dir(spec.name) / fitting.RECORD)
        self.checkpoints = JobCheckpoints(self.name, metrics, loop.post)
        self.stop_reason: str | None = None  # why a stop was asked: stop, removed, reload, shutdown, preempted
        self.next_spec: JobSpec | None = None
        self.backoff_until, self.last_status = 0.0, None  # last_status: the last worker's (`tpud run` exits with it)
        self.watch = HangWatch(spec.health, clock)
        self._preparing = False  # a start waits: for a thread fetching from GCS, or the fork server
        self.gang = GangView(gang, self.name, metrics)  # several hosts: this host's place, and its worker's gang
        self.tiers = CheckpointTiers(spec, paths, self.checkpoints.upload_result, uploads=self.gang.uploads)
        self._record_path = paths.layout.record_file(self.name)
        self.memory = JobMemory(self.name, paths.memory, memory_budget or MemoryBudget(share=0.25),
                                blank=not self._record_path.exists())
        self.forkserver = forkserver  # the daemon's: starts workers warm (restart.standby); None: always cold
        self.current = CurrentWorker(self.name, paths.channel(self.name), loop, lambda s, env: spawn(
            s, paths, log_format, env, forkserver=forkserver if s.restart.standby else None), self.watch,
                                     on_event=self.handle, on_exit=self.worker_exited)
        self.record = JobRecord.load(self._record_path)
        self.held = self.record.held  # an operator's `tpud stop` holds the job until `tpud start`
        self.restarts = Restarts(total=self.record.restarts_total, rollbacks=self.record.rollbacks,
                                 on_restart=lambda reason: self.metrics.restart(self.name, reason))
        self.ledger = goodput.Ledger.for_job(self.record.goodput, self.name, metrics, clock)
        self.metrics.job_series(self.name, tiers=CheckpointTiers.names(spec), restart_reasons=RESTART_REASONS)
        self.checkpoints.found_local(self.tiers.local_job_dir)
        self.tracker = JobTracker(spec.logging.wandb, job=self.name, directory=paths.job_dir(self.name),
                                  saved=self.record.wandb, newest_run_id=lambda: self.tiers.newest_run_id(),
                                  config=lambda: json.loads(self.spec.model_dump_json(by_alias=True)),
                                  tensorboard=spec.logging.tensorboard, goodput=self.ledger.snapshot)
        self.metrics.job_state(self.name, self.state.value)

    # --- the record ---

    def save(self) -> None:
        """Write job.json now (it is also written at every state change)."""
        self._saved_at = self.clock()
        r = self.record
        r.restarts_total, r.rollbacks, r.held = self.restarts.total, self.restarts.rollbacks, self.held
        r.goodput, r.wandb = self.ledger.to_dict(), self.tracker.to_dict()
        r.save(self._record_path, self.name)

    def _set(self, state: State, reason: str = "") -> None:
        if state is self.state:
            return
        states.check(self.state, state)
        log.info("job state", job=self.name, state=state.value, previous=self.state.value, reason=reason or None)
        self.record.history.append({"at": time.time(), "from": self.state.value, "to": state.value, "reason": reason})
        self.state = state
        self.metrics.job_state(self.name, state.value)
        if state in ENDED:
            self.tracker.finish_in_background()
            if state is State.SUCCEEDED or self.stop_reason == "removed":  # its final checkpoint is on disk
                self.memory.discard()
                self.checkpoints.memory_discarded()
        if self.worker is None and not self._preparing:
            waiting = state is State.STOPPED and self.stop_reason == "shutdown"  # resumes when tpud is back
            self.ledger.enter(goodput.DOWN if waiting else _LEDGER_PHASE.get(state, goodput.IDLE))
        self.save()

    @property
    def worker(self) -> WorkerProcess | None:
        return self.current.process

    # --- commands (from the daemon loop) ---

    def start(self) -> None:
        """Start (or restart) the worker, resuming from the newest committed checkpoint."""
        if self.worker is not None or self._preparing:
            return
        if self.next_spec is not None:  # a reload interrupted by a stop: the new spec wins
            self._adopt(self.next_spec)
        self.error, self.stop_reason, self.current.kill_at, self.error_detail = None, None, None, []
        if self.memory.worker_env(self.spec) is None:
            self.error = f"checkpoint.memory: {self.memory.refused}"
            self._set(State.FAILED, "the memory tier does not fit in its budget")
            return
        self.ledger.enter(goodput.WORKER)  # fetching from GCS is part of starting up
        urls = inputs.remote_urls(self.spec)
        if self.tiers.tier is None and not urls:
            self._spawn()
            return
        self._preparing = True
        self._set(State.STARTING, "fetching the newest checkpoint, the dataset and the model from GCS")
        inputs.fetch_in_background(self.tiers, urls, self.spec, self.paths.layout,
                                   lambda error: self.loop.post(lambda: self._prepared(error)))

    def _prepared(self, error: tuple[str, str] | None) -> None:
        self._preparing = False
        if self.stop_reason is not None:  # stopped while preparing; a reload starts again, with the new spec
            self.ledger.worker_exited(lost_work=False)
            if self.stop_reason == "reload":
                return self.start()
            self._set(State.PREEMPTED if self.stop_reason == "preempted" else State.STOPPED, self.stop_reason)
        elif error is not None:
            self.ledger.worker_exited(lost_work=True)
            self._crashed(*error)
        else:
            self._spawn()

    def _spawn(self) -> None:
        max_steps = self.spec.train.max_steps
        if self.gang.place is not None and self.checkpoints.holds_final(self.tiers.local_job_dir, max_steps):
            self._set(State.STARTING)  # a host back after its gang finished: a worker would wait for it for good
            return self._set(State.SUCCEEDED, "the gang's final step is committed here: nothing left to train")
        if self.spec.restart.standby and self.forkserver and not self.forkserver.ready():  # importing torch
            self._preparing = True
            self._set(State.STARTING, "the fork server is importing torch and the engine")
            self.forkserver.when_ready(lambda: self._prepared(None))
            return
        self.report.new_worker()
        self.gang.new_worker()
        rate = self.restarts.disruptions_per_hour(self.spec, self.ledger.wall_seconds)
        pid = self.current.start(self.spec, {**self.gang.worker_env(), **self.memory.env, **self.tracker.worker_env(),
                                             **self.tiers.worker_env(rate)}, ranks.processes_per_host(self.spec.device))
        self.record.first_started = self.record.first_started or time.time()
        self._set(State.STARTING, f"pid {pid}")

    def stop(self, reason: str, deadline_s: float | None = None) -> None:
        """Checkpoint and stop; a worker that does not stop in time is killed.

        With a deadline (a preemption, or the VM's shutdown), the checkpoint is taken at the
        earliest boundary that leaves time to write it: mid-step if the step would not finish.
        """
        self.stop_reason = reason
        if self._preparing:
            return  # _prepared() sees the stop
        if self.state in (State.STARTING, *TRAINING):
            budget = None if deadline_s is None else self.checkpoints.step_budget(deadline_s)
            self.current.request(Request(Action.CHECKPOINT_AND_EXIT, budget), fallback=signal.SIGTERM)
            grace = self.stop_timeout if deadline_s is None else deadline_s + self.spec.health.kill_grace_seconds
            self.current.kill_at = self.clock() + grace
            self._set(State.STOPPING, reason)
        elif self.state in WAITING:
            self._set(State.PREEMPTED if reason == "preempted" else State.STOPPED, reason)

    def preempt(self, deadline_s: float) -> None:
        """A preemption or TERMINATE notice: commit a checkpoint within the deadline, exit 75, PREEMPTED."""
        if self.state in ACTIVE or self.state in WAITING:
            self.stop("preempted", deadline_s=deadline_s)

    def notice_cleared(self) -> None:
        """The notice was withdrawn (the maintenance is over): a preempted job runs again."""
        if self.state is State.PREEMPTED and not self.held:
            self.start()

    def replace_spec(self, spec: JobSpec, file: Path) -> None:
        """The job file changed: checkpoint, stop, and start again with the new spec."""
        self.file, self.restarts.differing_since = file, None
        if self.state in ACTIVE:
            self.next_spec = spec
            if self.stop_reason is None:  # a stop under way (or asked while the start waits) wins
                self.stop("reload")
        else:
            self._adopt(spec)
            if not self.held:
                self.start()

    def _adopt(self, spec: JobSpec) -> None:
        self.spec, self.next_spec = spec, None
        self.tracker.adopt(spec.logging.wandb, spec.logging.tensorboard)
        self.metrics.job_series(self.name, tiers=CheckpointTiers.names(spec), restart_reasons=())  # a tier it gained
        self.tiers = self.tiers.adopt(spec)

    def checkpoint_now(self, deadline_s: float | None) -> Future:
        """A future resolved with the next committed local checkpoint (or an error)."""
        if self.state not in TRAINING:
            return self.checkpoints.refused(f"job {self.name} is {self.state.value}, not running")
        future = self.checkpoints.wait_for_next(after_step=self.watch.step)
        self.current.request(Request(Action.CHECKPOINT, deadline_s), fallback=signal.SIGUSR1)
        self._set(State.CHECKPOINTING, "requested")
        return future

    def fail(self, error: str) -> None:
        """An internal error while handling this job: treat it as a crash of its worker."""
        self.error = error
        if self.worker is not None:
            self.current.signal(signal.SIGKILL)  # their exit is then handled as a crash
        else:
            self._crashed(error, "internal")

    # --- the worker's events ---

    def handle(self, event: events.Event) -> None:
        """An event from the current worker (engine/events.py), for the parts that own it (routing.py)."""
        self.watch.heard()  # any message is a sign of life
        routing.route(self, event)

    def on_heartbeat(self, event: events.Heartbeat | events.Started) -> None:
        if self.state is State.STARTING:
            self._set(State.RUNNING)  # the loop is running: restore and compilation are behind it

    on_started = on_heartbeat

    def on_step(self, event: events.Step) -> None:
        if self.clock() - self._saved_at >= SAVE_EVERY_S:
            self.save()

    def on_checkpoint_committed(self, event: events.CheckpointCommitted) -> None:
        if event.tier != "memory" and self.state is State.CHECKPOINTING and not self.checkpoints.waiters:
            self._set(State.RUNNING, f"checkpoint at step {event.step}")

    def on_checkpoint_failed(self, event: events.CheckpointFailed) -> None:
        if event.tier != "memory" and self.state is State.CHECKPOINTING:
            self._set(State.RUNNING, "checkpoint failed")

    # --- the worker's exit ---

    def worker_exited(self, status: int) -> None:
        """The current worker exited with `status` (a shell-style status: 128 + N for signal N)."""
        self.current.release()
        self.last_status = status
        self.checkpoints.fail_waiters(f"worker exited ({status}) before the checkpoint")
        log.info("worker exited", job=self.name, status=status, stop_reason=self.stop_reason)
        self.ledger.worker_exited(lost_work=status not in (exit_codes.OK, exit_codes.STOPPED))
        if status == exit_codes.OK or (self.stop_reason != "reload"  # a worker failing after its final save
                                       and self.checkpoints.holds_step(self.spec.train.max_steps)):
            self._set(State.SUCCEEDED, "reached max_steps" + (f" (then exit {status})" if status else ""))
        elif self.stop_reason == "reload":  # however it exited, the new spec takes over
            self._adopt(self.next_spec or self.spec)
            self.start()
        elif self.stop_reason is not None:
            detail = "" if status == exit_codes.STOPPED else f" (exit {status}, no final checkpoint)"
            state = State.PREEMPTED if self.stop_reason == "preempted" else State.STOPPED
            self._set(state, self.stop_reason + detail)
        elif status == exit_codes.GANG_RESTART:  # another host's worker failed: meet the gang's next generation
            self.restarts.peer()  # the failing host spends its own restart budget; this one spends none
            self.gang.peer_restarts += 1
            self.start()
        elif status == exit_codes.REFIT:  # a smaller micro-batch is recorded in the job's state
            self.restarts.refit()
            self.start()
        elif self.current.hang is not None:
            self._crashed(self.current.hang, "hang")
        elif status == exit_codes.STOPPED:
            self.start()  # stopped on a request from outside the daemon: resume
        elif status == exit_codes.NONFINITE_LOSS:
            self._nonfinite_exit()
        elif status in (exit_codes.BAD_INPUT, exit_codes.QUARANTINED):  # never retried on this host
            self.error = self.current.output.last_error() or f"worker exited with {status}"
            wait = self.restarts.copies_differ(self.error, self.paths.watches(self.file), self.clock())
            self.backoff_until = self.clock() + (wait or 0.0)  # the hosts' copies change seconds apart
            self._set(State.FAILED if wait is None else State.BACKOFF, f"exit {status}" if wait is None
                      else "the hosts hold other versions of the job file: waiting for them to agree")
        else:
            crash = self.current.crash(status)
            self.error_detail = crash.detail
            self._crashed(crash.message, crash.reason)

    def _nonfinite_exit(self) -> None:
        """Exit 76: roll back to the newest checkpoint (the worker recorded the batches to skip), or fail."""
        again, self.error, reason = self.restarts.nonfinite(self.spec, *self.report.nonfinite_exit())
        self.backoff_until = self.clock()
        self._set(State.BACKOFF if again else State.FAILED, reason)

    def _crashed(self, error: str, reason: str) -> None:
        self.error = error
        delay = self.restarts.crashed(self.spec, self.clock(), reason)
        if delay is None:
            self._set(State.FAILED, f"{self.restarts.budget_spent_reason(self.spec)}; last: {reason}: {error}")
            return
        self.backoff_until = self.clock() + delay
        self._set(State.BACKOFF, f"{reason}; restart in {delay:.1f}s")

    # --- timers ---

    def tick(self) -> None:
        """Timers: backoff expiry, hang detection, killing a worker that ignored a stop."""
        now = self.clock()
        if self.state is State.BACKOFF and now >= self.backoff_until:
            self.start()
        self.current.tick(now, self.spec.health.kill_grace_seconds, gang=self.gang.place is not None)

    def next_timer(self) -> float | None:
        """When tick() next has something to do (the clock's time), so the loop wakes on time."""
        timers = [*self.current.timers(), self.backoff_until if self.state is State.BACKOFF else None]
        return min((t for t in timers if t is not None), default=None)

    # --- reading ---

    def close(self, timeout: float = 30.0) -> None:
        """The daemon is exiting: flush what is buffered for this job."""
        self.tracker.close(timeout)
        self.save()

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    def snapshot(self) -> dict:
        return snapshot.snapshot(self)

