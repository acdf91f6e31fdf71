"""One job under supervision: an explicit state machine around its worker process.

    PENDING -> STARTING -> RUNNING -> SUCCEEDED
                             |  |--> CHECKPOINTING -> RUNNING
                             |  |--> STOPPING -> STOPPED        (tpud stop, file removed, shutdown)
                             |  |--> STOPPING -> PREEMPTED      (preemption notice; waits for the host)
                             |  '--> BACKOFF -> STARTING        (crash, hang, non-finite loss rollback)
                             '--> FAILED                         (restart budget spent, exit 76/78)

Everything here runs on the daemon's main loop thread: the loop hands a job its worker's
output, channel messages, exit status and timer ticks, and the job decides. The worker's
exit code says what happened (engine/exit_codes.py, DESIGN.md); a worker that stops
heartbeating for longer than its health bound is hung, and is killed and restarted.
Restart counts, goodput and history persist in <state>/jobs/<job>/job.json, so a
restarted daemon carries on.
"""

from __future__ import annotations

import enum
import json
import signal
import statistics
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import structlog

from engine import exit_codes
from engine.backoff import Backoff
from engine.checkpoint import manifest as mf
from engine.spec.schema import JobSpec
from engine.layout import atomic_write
from tpud.job import crashes, goodput
from tpud.paths import Paths
from tpud.job.save_failures import SaveFailures
from tpud.checkpoints.tiers import CheckpointTiers
from tpud.worker import channel
from tpud.worker.process import WorkerProcess
from tpud.tracking import WandbRun, new_run_id

log = structlog.get_logger()


class State(str, enum.Enum):
    PENDING = "PENDING"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    CHECKPOINTING = "CHECKPOINTING"
    STOPPING = "STOPPING"
    STOPPED = "STOPPED"
    PREEMPTED = "PREEMPTED"
    BACKOFF = "BACKOFF"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"


ACTIVE = {State.STARTING, State.RUNNING, State.CHECKPOINTING, State.STOPPING}
ENDED = {State.STOPPED, State.PREEMPTED, State.SUCCEEDED, State.FAILED}  # no worker, none coming by itself
# Where the goodput ledger books the time a job spends in a state without a worker.
_LEDGER_PHASE = {State.BACKOFF: goodput.BACKOFF, State.PREEMPTED: goodput.DOWN}
# Host-side scalars of a `step` event that go to wandb.
WANDB_SCALARS = ("loss", "grad_norm", "lr", "tokens_per_s", "step_time_s", "mfu", "rss_bytes", "device_memory_bytes")
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
    def checkpoint(self, job: str, *, tier: str, reason: str, seconds: float, bytes: int, step: int) -> None: ...
    def checkpoint_failure(self, job: str, tier: str) -> None: ...
    def goodput(self, job: str, ratio: float) -> None: ...
    def badput(self, job: str, kind: str, seconds: float) -> None: ...


@dataclass
class Checkpoint:
    step: int
    micro_step: int
    tier: str
    path: str
    at: float  # wall time


@dataclass
class Waiter:
    """A `tpud checkpoint-now` caller waiting for the next local commit."""

    future: Future
    after_step: int = 0  # only a checkpoint of this step or later answers the request
    since: float = field(default_factory=time.monotonic)


class Job:
    def __init__(self, spec: JobSpec, file: Path, paths: Paths, loop: Loop, metrics: MetricsSink,
                 *, stop_timeout: float, log_format: str = "json", clock=time.monotonic):
        self.spec, self.file, self.paths, self.loop, self.metrics = spec, file, paths, loop, metrics
        self.clock, self.stop_timeout, self.log_format = clock, stop_timeout, log_format
        self.last_status: int | None = None  # the last worker's exit status
        self.name = spec.name
        self.state = State.PENDING
        self.error: str | None = None
        self.progress: dict = {}
        self.last_checkpoint: Checkpoint | None = None
        self.save_failures = SaveFailures()
        self.worker: WorkerProcess | None = None
        self.standbys: list[WorkerProcess] = []  # warm spares for the next starts (restart.standby)
        self.listener: channel.Listener | None = None
        self.connection: channel.Connection | None = None
        self.tiers = CheckpointTiers(spec, paths, self._uploaded)
        self.waiters: list[Waiter] = []
        self.stop_reason: str | None = None  # why a stop was asked: stop, removed, reload, shutdown
        self.next_spec: JobSpec | None = None
        self.backoff_until = 0.0
        self.kill_at: float | None = None
        self._partial = b""
        self.tail: deque[str] = deque(maxlen=100)  # the worker's last output lines, for crash reports
        self.error_detail: list[str] = []
        self._state_file = paths.job_dir(self.name) / "job.json"
        persisted = self._load()
        self.restarts_total: int = persisted.get("restarts_total", 0)
        self.rollbacks: int = persisted.get("rollbacks", 0)
        self.crash_times: deque[float] = deque()  # monotonic, within the restart window
        self.crash_streak = 0  # crashes since a worker last committed a checkpoint: the backoff's exponent
        self.first_started: float | None = persisted.get("first_started")
        self.history: list[dict] = persisted.get("history", [])
        # An operator's `tpud stop` holds the job stopped until `tpud start`, across daemon restarts.
        self.held: bool = persisted.get("held", False)
        self.digest: str | None = None  # of the job file this spec came from
        self.heartbeat_step = 0  # the step of the worker's latest heartbeat
        self._preparing = False  # a thread is fetching the newest checkpoint from GCS
        # Health: when we last heard from the worker, and what is normal for it.
        self.last_heard = self.clock()
        self.started_step: int | None = None  # where the current worker's loop began
        self.step_times: deque[float] = deque(maxlen=64)
        self.saving_since: float | None = None  # a checkpoint is being written
        self.save_seconds = 0.0  # how long the last local checkpoint took, for preemption deadlines
        self.hang: str | None = None  # why the current worker was judged hung
        self.nonfinite: dict | None = None  # the current worker's `nonfinite` event
        self._oom_kills: int | None = None
        self.rank = 0
        # Goodput: every second since the first start, productive or badput by kind.
        self.ledger = goodput.Ledger(persisted.get("goodput"), clock=clock,
                                     on_badput=lambda kind, seconds: self.metrics.badput(self.name, kind, seconds))
        for kind, seconds in self.ledger.badput.items():
            self.metrics.badput(self.name, kind, seconds)
        self._saved_at = self.clock()
        # wandb: one run per job, whatever restarts; its steps never go back.
        wandb = persisted.get("wandb", {})
        self.wandb_run_id: str | None = wandb.get("run_id")
        self.wandb_step: int = wandb.get("step", 0)
        self.wandb: WandbRun | None = None
        self.metrics.job_state(self.name, self.state.value)

    # --- persistence ---

    def _load(self) -> dict:
        try:
            return json.loads(self._state_file.read_text())
        except (OSError, ValueError):
            return {}

    def _save(self) -> None:
        self._saved_at = self.clock()
        try:
            atomic_write(self._state_file, json.dumps({
                "restarts_total": self.restarts_total, "rollbacks": self.rollbacks,
                "first_started": self.first_started, "held": self.held, "goodput": self.ledger.to_dict(),
                "wandb": {"run_id": self.wandb_run_id, "step": self.wandb_step}, "history": self.history[-50:]},
                indent=1))
        except OSError as e:  # a full or read-only disk must not stop the job; the previous record stays
            log.warning("cannot write the job record; keeping the previous one", job=self.name,
                        path=str(self._state_file), error=str(e))

    def _set(self, state: State, reason: str = "") -> None:
        if state is self.state:
            return
        log.info("job state", job=self.name, state=state.value, previous=self.state.value, reason=reason or None)
        self.history.append({"at": time.time(), "from": self.state.value, "to": state.value, "reason": reason})
        self.state = state
        self.metrics.job_state(self.name, state.value)
        if state in ENDED:
            self._discard_standbys()
        elif state is State.BACKOFF and self.standbys:  # a restart will take a spare: start its successor
            self._ensure_standbys(self.standbys[0].extra_env, 2)
        if state in ENDED and self.wandb is not None:  # finish the run; a restart resumes it
            threading.Thread(target=self.wandb.close, name=f"wandb-{self.name}", daemon=True).start()
            self.wandb = None
        if self.worker is None and not self._preparing:
            waiting = state is State.STOPPED and self.stop_reason == "shutdown"  # resumes when tpud is back
            self.ledger.enter(goodput.DOWN if waiting else _LEDGER_PHASE.get(state, goodput.IDLE))
        self._save()

    # --- commands (from the daemon loop) ---

    def start(self) -> None:
        """Start (or restart) the worker, resuming from the newest committed checkpoint."""
        if self.worker is not None or self._preparing:
            return
        if self.next_spec is not None:  # a reload interrupted by a stop: the new spec wins
            self._adopt(self.next_spec)
        self.error, self.stop_reason, self.kill_at, self.error_detail = None, None, None, []
        self.ledger.enter(goodput.WORKER)  # fetching from GCS is part of starting up
        if self.tiers.tier is None:
            self._spawn()
            return
        # Listing and downloading from GCS can take minutes: never on the loop thread.
        self._preparing = True
        self._set(State.STARTING, "fetching the newest checkpoint from GCS")
        threading.Thread(target=self._prepare, name=f"prepare-{self.name}", daemon=True).start()

    def _prepare(self) -> None:
        try:
            self.tiers.prepare()
        except Exception as e:  # an unreachable GCS tier: retry later, like a crash
            error = f"cannot prepare checkpoints: {e}"
            self.loop.post(lambda: self._prepared(error))
        else:
            self.loop.post(lambda: self._prepared(None))

    def _prepared(self, error: str | None) -> None:
        self._preparing = False
        if self.stop_reason is not None:  # stopped while preparing
            self.ledger.worker_exited(lost_work=False)
            self._set(State.PREEMPTED if self.stop_reason == "preempted" else State.STOPPED, self.stop_reason)
        elif error is not None:
            self.ledger.worker_exited(lost_work=True)
            self._crashed(error, "checkpoint_tier")
        else:
            self._spawn()

    def _spawn(self) -> None:
        env = {"TPUD_CHANNEL": str(self.paths.runtime / "jobs" / f"{self.name}.sock")}
        if self.spec.logging.wandb is not None:
            env["TPUD_WANDB_RUN_ID"] = self._wandb_run_id()
        self.listener = channel.Listener(Path(env["TPUD_CHANNEL"]))
        self.loop.watch(self.listener, self._on_accept)
        self._oom_kills = crashes.oom_kill_count()
        self.tail.clear()
        self.hang, self.nonfinite, self.started_step, self.saving_since = None, None, None, None
        self.last_heard = self.clock()
        self.worker, warm = self._take_standby(env), True
        if self.worker is None:
            self.worker, warm = WorkerProcess(self.spec, self.paths, self.log_format, extra_env=env), False
        self.loop.watch(self.worker.stdout, self._on_output)
        log.info("worker started", job=self.name, pid=self.worker.pid, standby=warm)
        self._ensure_standbys(env, 1)
        if self.first_started is None:
            self.first_started = time.time()
        self._set(State.STARTING, f"pid {self.worker.pid}")

    # --- the warm spare ---

    def _take_standby(self, env: dict[str, str]) -> WorkerProcess | None:
        while self.standbys:
            standby = self.standbys.pop(0)
            if standby.extra_env == env and standby.release(self.spec):
                return standby
            standby.discard()
        return None

    def _ensure_standbys(self, env: dict[str, str], count: int) -> None:
        """Keep `count` warm spares, so restarts skip the imports.

        One starts beside a cold worker: the two import side by side (an import uses one core).
        When a restart is due, the spare it will take gets a successor at once, whose imports
        (at the lowest CPU priority) then overlap the backoff and the restore, not only training.
        """
        while self.spec.restart.standby and len(self.standbys) < count:
            standby = WorkerProcess(self.spec, self.paths, self.log_format, extra_env=env, standby=True)
            self.standbys.append(standby)
            log.info("standby worker started", job=self.name, pid=standby.pid)

    def _discard_standbys(self) -> None:
        for standby in self.standbys:
            standby.discard()
        self.standbys.clear()

    def stop(self, reason: str, deadline_s: float | None = None) -> None:
        """Checkpoint and stop; a worker that does not stop in time is killed.

        With a deadline (a preemption, or the VM's shutdown), the checkpoint is taken at the
        earliest boundary that leaves time to write it: mid-step if the step would not finish.
        """
        self.stop_reason = reason
        if self._preparing:
            return  # _prepared() sees the stop
        if self.state in (State.STARTING, State.RUNNING, State.CHECKPOINTING):
            if deadline_s is None:
                self._request("checkpoint_and_exit", deadline_s=None, fallback=signal.SIGTERM)
                self.kill_at = self.clock() + self.stop_timeout
            else:
                self._request("checkpoint_and_exit", deadline_s=self._step_budget(deadline_s), fallback=signal.SIGTERM)
                self.kill_at = self.clock() + deadline_s + self.spec.health.kill_grace_seconds
            self._set(State.STOPPING, reason)
        elif self.state in (State.PENDING, State.BACKOFF):
            self._set(State.PREEMPTED if reason == "preempted" else State.STOPPED, reason)

    def _step_budget(self, deadline_s: float) -> float:
        """Of `deadline_s`, the time the worker may spend finishing its step: the rest writes the checkpoint."""
        return max(0.0, deadline_s - 1.5 * self.save_seconds - 1.0)

    def preempt(self, deadline_s: float) -> None:
        """A preemption or TERMINATE notice: commit a checkpoint within the deadline, exit 75, PREEMPTED."""
        if self.state in ACTIVE or self.state in (State.PENDING, State.BACKOFF):
            self.stop("preempted", deadline_s=deadline_s)

    def notice_cleared(self) -> None:
        """The notice was withdrawn (the maintenance is over): a preempted job runs again."""
        if self.state is State.PREEMPTED and not self.held:
            self.start()

    def replace_spec(self, spec: JobSpec, file: Path) -> None:
        """The job file changed: checkpoint, stop, and start again with the new spec."""
        self.file = file
        if self.state in ACTIVE:
            self.next_spec = spec
            if self.state is not State.STOPPING:
                self.stop("reload")
        else:
            self._adopt(spec)
            if not self.held:
                self.start()

    def _adopt(self, spec: JobSpec) -> None:
        old_remote = self.spec.checkpoint.remote
        self.spec, self.next_spec = spec, None
        self._discard_standbys()  # it warmed up for the old spec (another backend, perhaps)
        if spec.checkpoint.remote != old_remote or spec.checkpoint.keep != self.tiers.keep:
            # The old uploader finishes its upload in flight in the background, then stops.
            threading.Thread(target=self.tiers.close, name=f"close-uploads-{self.name}", daemon=True).start()
            self.tiers = CheckpointTiers(spec, self.paths, self._uploaded)

    def checkpoint_now(self, deadline_s: float | None) -> Future:
        """A future resolved with the next committed local checkpoint (or an error)."""
        waiter = Waiter(Future(), after_step=self.heartbeat_step)
        if self.state not in (State.RUNNING, State.CHECKPOINTING):
            waiter.future.set_exception(RuntimeError(f"job {self.name} is {self.state.value}, not running"))
            return waiter.future
        self.waiters.append(waiter)
        self._request("checkpoint", deadline_s=deadline_s, fallback=signal.SIGUSR1)
        self._set(State.CHECKPOINTING, "requested")
        return waiter.future

    def _request(self, action: str, deadline_s: float | None, fallback: int) -> None:
        sent = self.connection is not None and self.connection.send(
            {"type": "request", "action": action, "deadline_s": deadline_s})
        if not sent and self.worker is not None:
            self.worker.signal(fallback)  # the signal fallback: same meaning, next boundary

    # --- what the loop hands us ---

    def fail(self, error: str) -> None:
        """An internal error while handling this job: treat it as a crash of its worker."""
        self.error = error
        if self.worker is not None:
            self.worker.signal(signal.SIGKILL)  # its exit is then handled as a crash
        else:
            self._crashed(error, "internal")

    def _on_accept(self) -> None:
        if self.listener is None:
            return
        connection = self.listener.accept()
        if connection is None:
            return
        if self.connection is not None:
            self.loop.unwatch(self.connection)
            self.connection.close()
        self.connection = connection
        self.loop.watch(connection, self._on_channel)

    def _on_channel(self) -> None:
        if self.connection is None:
            return
        messages = self.connection.receive()
        if messages is None:
            self.loop.unwatch(self.connection)
            self.connection.close()
            self.connection = None
            return
        for message in messages:
            self._on_message(message)

    def _on_message(self, message: dict) -> None:
        kind = message.get("type")
        self.last_heard = self.clock()
        if kind in ("hello", "heartbeat"):
            self.metrics.heartbeat(self.name, self.clock())
            if isinstance(message.get("step"), int):
                self.heartbeat_step = message["step"]
            self.saving_since = None  # the loop runs on: an async save needs no allowance
        if kind == "hello" and isinstance(message.get("rank"), int):
            self.rank = message["rank"]
        if kind == "heartbeat" and self.state is State.STARTING:
            self._set(State.RUNNING)  # the loop is running: restore and compilation are behind it
        if kind != "event":
            return
        event = message.get("event")
        if event == "started":
            self._started(message)
        elif event == "step":
            self._step(message)
        elif event == "checkpoint_started":
            self.saving_since = self.clock()
        elif event == "checkpoint_committed":
            self.saving_since = None
            self._committed(message)
        elif event == "checkpoint_restored":
            self.progress.setdefault("step", message.get("step"))
        elif event == "nonfinite":
            self.nonfinite = message
        elif event == "checkpoint_failed":
            self.saving_since = None
            self.metrics.checkpoint_failure(self.name, "local")
            step = message.get("step")
            self.save_failures.failed("local", str(message.get("error") or "unknown error"),
                                      step if isinstance(step, int) else None)
            for waiter in self.waiters:
                waiter.future.set_exception(RuntimeError(message.get("error", "checkpoint failed")))
            self.waiters.clear()
            if self.state is State.CHECKPOINTING:
                self._set(State.RUNNING, "checkpoint failed")

    def _started(self, message: dict) -> None:
        step = message.get("step") if isinstance(message.get("step"), int) else 0
        self.started_step = self.heartbeat_step = step
        self.ledger.worker_started(step, _counters(message))
        if self.state is State.STARTING:
            self._set(State.RUNNING)

    def _step(self, message: dict) -> None:
        step = message.get("step")
        if not isinstance(step, int):
            return
        self.heartbeat_step = step
        self.metrics.heartbeat(self.name, self.clock())
        self.progress = {k: message.get(k) for k in ("step", "loss", "tokens_per_s", "mfu")}
        self.metrics.job_progress(self.name, step=step, loss=message.get("loss"),
                                  tokens_per_second=message.get("tokens_per_s"), mfu=message.get("mfu"))
        if isinstance(message.get("step_time_s"), (int, float)):
            self.step_times.append(float(message["step_time_s"]))
        self.ledger.worker_report(step, _counters(message))
        if self.ledger.ratio is not None:
            self.metrics.goodput(self.name, self.ledger.ratio)
        self._track(step, message)
        if self.clock() - self._saved_at >= SAVE_EVERY_S:
            self._save()

    def _committed(self, message: dict) -> None:
        if not isinstance(message.get("step"), int) or not isinstance(message.get("path"), str):
            return  # not something our worker sends
        if isinstance(message.get("seconds"), (int, float)) and message["seconds"] > 0:
            self.save_seconds = float(message["seconds"])
        checkpoint = Checkpoint(message["step"], message.get("micro_step", 0), "local", message["path"], time.time())
        self.last_checkpoint = checkpoint
        self.save_failures.committed("local")
        self.crash_streak = 0  # it made progress: not a crash loop
        self.metrics.checkpoint(self.name, tier="local", reason=message.get("reason", ""),
                                seconds=message.get("seconds", 0.0), bytes=message.get("bytes", 0),
                                step=checkpoint.step)
        if self.tiers.uploader is not None:
            self.tiers.uploader.submit(Path(checkpoint.path))
        result = {"job": self.name, "ok": True, "step": checkpoint.step, "micro_step": checkpoint.micro_step,
                  "tier": "local", "path": checkpoint.path, "seconds": message.get("seconds")}
        # An older save still being written when the request came does not answer it.
        answered = [w for w in self.waiters if checkpoint.step >= w.after_step]
        for waiter in answered:
            waiter.future.set_result({**result, "seconds": round(time.monotonic() - waiter.since, 3)})
        self.waiters = [w for w in self.waiters if w not in answered]
        if self.state is State.CHECKPOINTING and not self.waiters:
            self._set(State.RUNNING, f"checkpoint at step {checkpoint.step}")

    def _uploaded(self, key: tuple[int, int], transfer) -> None:
        """From the uploader's thread: the GCS tier's metrics, and status's newest checkpoint."""
        if transfer is None:
            self.metrics.checkpoint_failure(self.name, "gcs")
            uploader = self.tiers.uploader
            error = (uploader.stats().last_error if uploader is not None else None) or "upload failed"
            self.loop.post(lambda: self.save_failures.failed("gcs", error, key[0]))
            return
        self.metrics.checkpoint(self.name, tier="gcs", reason="upload", seconds=transfer.seconds,
                                bytes=transfer.bytes, step=key[0])
        self.loop.post(lambda: self._uploaded_on_loop(key))

    def _uploaded_on_loop(self, key: tuple[int, int]) -> None:
        self.save_failures.committed("gcs")
        last = self.last_checkpoint
        if last is None or (key[0], key[1]) >= (last.step, last.micro_step):
            self.last_checkpoint = Checkpoint(key[0], key[1], "gcs", "", time.time())

    def _on_output(self) -> None:
        chunk = self.worker.stdout.read(65536)
        if chunk:
            # Relay the worker's log (JSON lines) to ours; remember its last error for status.
            self.loop.relay(chunk)
            *lines, self._partial = (self._partial + chunk).split(b"\n")
            self._partial = self._partial[-65536:]  # a worker printing without newlines
            self.tail.extend(line.decode(errors="replace")[-2000:] for line in lines)
            return
        if self._partial:
            self.tail.append(self._partial.decode(errors="replace")[-2000:])
            self._partial = b""
        self.loop.unwatch(self.worker.stdout)
        self._exited(self.worker.wait())

    def _release(self) -> None:
        if self.connection is not None:
            self.loop.unwatch(self.connection)
            self.connection.close()
            self.connection = None
        if self.listener is not None:
            self.loop.unwatch(self.listener)
            self.listener.close()
            self.listener = None
        self.worker, self.kill_at = None, None

    def _exited(self, status: int) -> None:
        self._release()
        self.last_status = status
        for waiter in self.waiters:
            waiter.future.set_exception(RuntimeError(f"worker exited ({status}) before the checkpoint"))
        self.waiters.clear()
        log.info("worker exited", job=self.name, status=status, stop_reason=self.stop_reason)
        self.ledger.worker_exited(lost_work=status not in (exit_codes.OK, exit_codes.STOPPED))
        if status == exit_codes.OK:
            self._set(State.SUCCEEDED, "reached max_steps")
        elif self.stop_reason == "reload":  # however it exited, the new spec takes over
            self._adopt(self.next_spec or self.spec)
            self.start()
        elif self.stop_reason is not None:
            detail = "" if status == exit_codes.STOPPED else f" (exit {status}, no final checkpoint)"
            state = State.PREEMPTED if self.stop_reason == "preempted" else State.STOPPED
            self._set(state, self.stop_reason + detail)
        elif self.hang is not None:
            self._crashed(self.hang, "hang")
        elif status == exit_codes.STOPPED:
            self.start()  # stopped on a request from outside the daemon: resume
        elif status == exit_codes.NONFINITE_LOSS:
            self._nonfinite_exit()
        elif status == exit_codes.BAD_INPUT:
            self.error = _last_error(self.tail) or f"worker exited with {status}"
            self._set(State.FAILED, f"exit {status}")
        else:
            crash = crashes.classify(status, list(self.tail), oom_kills_before=self._oom_kills,
                                     oom_kills_after=crashes.oom_kill_count())
            self.error_detail = crash.detail
            self._crashed(crash.message, crash.reason)

    def _nonfinite_exit(self) -> None:
        """Exit 76: roll back to the newest checkpoint (the worker recorded the batches to skip), or fail."""
        event = self.nonfinite or {}
        what = f"non-finite loss ({event.get('loss')}) at step {event.get('step', '?')}"
        health = self.spec.health
        if event.get("policy") == "rollback" and self.rollbacks < health.max_rollbacks:
            self.rollbacks += 1
            self.restarts_total += 1
            self.metrics.restart(self.name, "nonfinite")
            self.error = what
            self.backoff_until = self.clock()
            self._set(State.BACKOFF, f"{what}; rollback {self.rollbacks} of {health.max_rollbacks}")
            return
        spent = f"; {self.rollbacks} rollbacks spent" if event.get("policy") == "rollback" else ""
        self.error = what + spent
        self._set(State.FAILED, f"exit 76: {what}{spent}")

    def _crashed(self, error: str, reason: str) -> None:
        self.error = error
        policy, now = self.spec.restart, self.clock()
        while self.crash_times and now - self.crash_times[0] > policy.window_seconds:
            self.crash_times.popleft()
        if len(self.crash_times) >= policy.max_restarts:
            self._set(State.FAILED, f"restart budget spent ({len(self.crash_times)} restarts within "
                                    f"{policy.window_seconds:.0f}s); last: {reason}: {error}")
            return
        self.crash_times.append(now)
        self.restarts_total += 1
        self.metrics.restart(self.name, reason)
        delay = Backoff(policy.backoff_initial_seconds, policy.backoff_max_seconds).delay(self.crash_streak + 1)
        self.crash_streak += 1
        self.backoff_until = now + delay
        self._set(State.BACKOFF, f"{reason}; restart in {delay:.1f}s")

    def tick(self) -> None:
        """Timers: backoff expiry, hang detection, and killing a worker that ignored a stop."""
        now = self.clock()
        if self.state is State.BACKOFF and now >= self.backoff_until:
            self.start()
        if self.kill_at is not None and now >= self.kill_at and self.worker is not None:
            log.warning("worker did not stop in time; killing it", job=self.name)
            self.worker.signal(signal.SIGKILL)
            self.kill_at = None
        if self.worker is not None and self.hang is None and self.kill_at is None:
            silent, bound = now - self.last_heard, self.hang_bound()
            if silent > bound:
                self.hang = (f"hung: no heartbeat for {silent:.0f}s (bound {bound:.0f}s) "
                             f"after step {self.heartbeat_step}")
                log.error("worker hung; terminating it", job=self.name, silent_s=round(silent, 3),
                          bound_s=round(bound, 1), step=self.heartbeat_step)
                if self.worker.stopped():  # SIGTERM would wait for a SIGCONT: no grace to give
                    self.worker.signal(signal.SIGKILL)
                else:
                    self.worker.signal(signal.SIGTERM)  # a worker that is merely slow still checkpoints and exits
                    self.kill_at = now + self.spec.health.kill_grace_seconds

    def next_timer(self) -> float | None:
        """When tick() next has something to do (the clock's time), so the loop wakes on time."""
        timers = [self.kill_at]
        if self.state is State.BACKOFF:
            timers.append(self.backoff_until)
        if self.worker is not None and self.hang is None and self.kill_at is None:
            timers.append(self.last_heard + self.hang_bound())
        return min((t for t in timers if t is not None), default=None)

    def hang_bound(self) -> float:
        """Seconds of silence after which the worker counts as hung."""
        health = self.spec.health
        if self.started_step is None or self.heartbeat_step < self.started_step + health.startup_steps:
            return health.startup_timeout_seconds  # restore and compilation
        bound = health.heartbeat_timeout_seconds
        if self.step_times:
            bound = max(bound, health.hang_step_multiple * statistics.median(self.step_times))
        if self.saving_since is not None:
            bound = max(bound, health.checkpoint_timeout_seconds)
        return bound

    # --- wandb ---

    def _wandb_run_id(self) -> str:
        """Created once per job: kept in job.json and every manifest, so another host continues the run."""
        if self.wandb_run_id is None:
            newest = mf.committed_steps(self.tiers.local_job_dir)
            self.wandb_run_id = (newest[-1][2].wandb_run_id if newest else None) or new_run_id()
            self._save()
        return self.wandb_run_id

    def _track(self, step: int, message: dict) -> None:
        cfg = self.spec.logging.wandb
        if cfg is None or self.rank != 0:  # one logger per job: the host of rank 0
            return
        if self.wandb is None:
            self.wandb = WandbRun(cfg, job=self.name, run_id=self._wandb_run_id(),
                                  directory=self.paths.job_dir(self.name),
                                  config=json.loads(self.spec.model_dump_json(by_alias=True)),
                                  last_step=self.wandb_step)
        self.wandb.log({k: message.get(k) for k in WANDB_SCALARS}, step=step)
        self.wandb_step = self.wandb.last_step

    def close(self, timeout: float = 30.0) -> None:
        """The daemon is exiting: flush what is buffered for this job."""
        self._discard_standbys()
        if self.wandb is not None:
            self.wandb.close(timeout)
            self.wandb = None
        self._save()

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    def snapshot(self) -> dict:
        last = self.last_checkpoint
        return {
            "name": self.name, "state": self.state.value, "file": str(self.file),
            "pid": None if self.worker is None else self.worker.pid,
            "step": self.progress.get("step"), "max_steps": self.spec.train.max_steps,
            "loss": self.progress.get("loss"), "tokens_per_second": self.progress.get("tokens_per_s"),
            "mfu": self.progress.get("mfu"), "restarts": self.restarts_total,
            "last_checkpoint": None if last is None else {"step": last.step, "tier": last.tier,
                                                          "age_seconds": round(time.time() - last.at, 1)},
            "error": self.error, "error_detail": self.error_detail,
            "warnings": self.save_failures.warnings(), "checkpoint_failures": self.save_failures.snapshot(),
            "age_seconds": None if self.first_started is None else round(time.time() - self.first_started, 1),
            "goodput": self.ledger.snapshot(),
        }


def _counters(message: dict) -> dict:
    """The worker's cumulative badput counters from a `started` or `step` event."""
    counters = message.get("badput")
    if not isinstance(counters, dict):
        return {}
    return {k: float(v) for k, v in counters.items() if k in goodput.WORKER_KINDS and isinstance(v, (int, float))}


def _last_error(tail) -> str | None:
    """The worker's last error line (it logs JSON lines; a traceback is plain text)."""
    for line in reversed(tail):
        if '"level": "error"' in line or "Traceback" in line or "Error" in line[:80]:
            return line
    return None
