"""`tpud daemon`: the long-running service that systemd starts.

One thread owns all job state and runs the loop: worker output and exits, worker
channels, timers, and the calls other threads post (the control socket, the job-file
watcher and the metrics server run in threads of their own and never touch a job
directly). Job files and tpud.yaml are read and validated in a helper process (tpud/jobfiles/offloop.py),
so a hostile file never delays `tpud status` or the watchdog. Signal handlers only
record; the loop acts (supervisord's discipline). A helper process that dies (the reader, the
fork server that starts workers warm, host 0's gang coordinator) is seen as it happens and started
again (tpud/children/respawn.py), and none can hold up the daemon's exit.

Preemption: the GCE metadata server's preempted and TERMINATE maintenance notices make
every job commit a checkpoint within the deadline and become PREEMPTED; a MIGRATE or an
upcoming maintenance takes a checkpoint and carries on. SIGTERM (the VM's shutdown path)
checkpoints every job within the same deadline, lets pending GCS uploads finish within
the stop budget, and exits 0. SIGHUP: reload tpud.yaml and rescan jobs.d. The daemon
never imports torch: workers are separate processes.
"""

from __future__ import annotations

import contextlib
import os
import queue
import selectors
import signal
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from engine.spec.loader import LoadedSpec
from engine.spec.schema import JobSpec
from tpud import __version__
from tpud.control import ControlError, ControlServer
from tpud.job.job import Job, State
from tpud.job.memory import MemoryBudget
from tpud.jobfiles.offloop import OffLoop, Reloaded, read_jobs, refusal, reload
from tpud.gang.board import Boards, gang_rows
from tpud.jobfiles.reading import JobFile
from tpud.jobfiles.remote import RemoteJobs
from tpud.jobfiles.watcher import Watcher
from tpud.metadata import MetadataWatcher, Notice, resolve_host
from tpud.metrics.series import Metrics, write_address_file
from tpud.notify import Notifier
from tpud.paths import Paths
from tpud.worker.gang.coordinator import Coordinator
from tpud.gang.discovery import discover
from tpud.settings import load_settings
from tpud.worker.forkserver import ForkServer

if TYPE_CHECKING:
    from tpud.view.live import LiveView

log = structlog.get_logger()
TICK_S = 0.5


class Daemon:
    """The service; with `single` set, `tpud run`: one job, no watcher or control socket,
    and the loop ends when that job does."""

    def __init__(self, paths: Paths, metrics_addr: str | None = None, single: tuple[JobSpec, Path] | None = None,
                 worker_log_format: str = "json", view: LiveView | None = None):
        self.paths, self.single, self.worker_log_format = paths, single, worker_log_format
        self.view = view  # `tpud run` on a terminal: the worker's output goes to it, not to stdout
        self.settings, settings_error = load_settings(paths.config)
        if settings_error:
            log.error("invalid settings file; using defaults", error=settings_error)
        self._reader_settings = self.settings  # the settings scans use: the reader thread's own copy
        # Several hosts: this one's place, fixed for the daemon's life (a TPU slice does not change shape).
        self.gang, self._gang_settings = discover(self.settings), self.settings.gang
        own = self.gang.own_coordinator if self.gang else None
        self.coordinator = Coordinator(own, self) if own is not None else None
        self.metrics_addr = metrics_addr or self.settings.metrics_addr
        self.selector = selectors.DefaultSelector()
        self.jobs: dict[str, Job] = {}
        self.invalid: dict[Path, str] = {}  # job files that do not validate, with their errors
        self.notifier = Notifier()
        self.metrics = Metrics()
        self.memory_budget = MemoryBudget(share=self.settings.memory_tier_max_share)
        self.forkserver = ForkServer(self)  # started with the first worker a job wants
        self._calls: queue.SimpleQueue[tuple[Callable, Future]] = queue.SimpleQueue()
        self._signals: list[int] = []
        self.offloop: OffLoop | None = None  # reads jobs.d and tpud.yaml (the service only)
        self.remote_jobs: RemoteJobs | None = None  # remote_jobs' poller (the service only, when set)
        self.boards = Boards()  # each gang job's hosts' rows, shared through GCS (tpud status --gang)
        self._stopping_since: float | None = None
        self.notice: Notice | None = None  # the preemption or TERMINATE notice in force
        self._loop_done = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    # --- the Loop interface jobs use ---

    def watch(self, fileobj, callback: Callable[[], None]) -> None:
        self.selector.register(fileobj, selectors.EVENT_READ, callback)

    def unwatch(self, fileobj) -> None:
        try:
            self.selector.unregister(fileobj)
        except (KeyError, ValueError):
            pass

    def relay(self, output: bytes) -> None:
        if self.view is not None:
            self.view.relay(output)
            return
        sys.stdout.buffer.write(output)
        sys.stdout.buffer.flush()

    # --- crossing threads ---

    def wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # already awake

    def call(self, fn: Callable, timeout: float = 30.0):
        """Run fn on the loop thread and return its result (called from other threads)."""
        future: Future = Future()
        if self._loop_done:
            raise ControlError("not_running", "the daemon is shutting down")
        self._calls.put((fn, future))
        self.wake()
        return future.result(timeout)

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    # --- job files (read off the loop: see tpud/jobfiles/offloop.py) ---

    def _on_files_changed(self) -> None:
        """From the watcher's (or remote_jobs' poller's) thread: jobs.d or the mirror may have changed."""
        if self.offloop is not None:
            self.offloop.submit("jobs", read_jobs, lambda: (self.paths.jobs_dir, self._reader_settings, self.paths.config,
                                                            self._remote_mirror()), self.reconcile)

    def _remote_mirror(self) -> tuple[Path, str] | None:
        return None if self.remote_jobs is None else (self.remote_jobs.mirror, self.remote_jobs.url)

    def _reload(self) -> None:
        """SIGHUP: tpud.yaml again, then jobs.d under the new settings."""
        def seen(result: Reloaded) -> None:  # every scan after this one uses them, before the loop has them
            self._reader_settings = result.settings

        def then(result: Reloaded) -> None:
            self.settings = result.settings
            self.memory_budget.share = result.settings.memory_tier_max_share
            if result.settings.gang != self._gang_settings:
                log.warning("the gang settings changed: they take effect when tpud restarts")
            if result.settings.remote_jobs != (self.remote_jobs.url if self.remote_jobs else None):
                log.warning("remote_jobs changed: it takes effect when tpud restarts")
            log.info("reloaded settings and rescanned jobs", error=result.error)
            self.reconcile(result.files)

        if self.offloop is not None:
            self.offloop.submit("reload", reload, lambda: (self.paths.jobs_dir, self.paths.config, self._remote_mirror()),
                                then, seen)
        if self.remote_jobs is not None:
            self.remote_jobs.poke()

    def _start_single(self) -> None:
        """`tpud run`: its one job, validated by the caller."""
        spec, file = self.single
        job = self.jobs[spec.name] = Job(spec, file, self.paths, self, self.metrics,
                                         stop_timeout=self.settings.job_stop_timeout_seconds,
                                         log_format=self.worker_log_format, gang=self.gang,
                                         memory_budget=self.memory_budget, forkserver=self.forkserver)
        job.start()

    def reconcile(self, files: dict[Path, JobFile]) -> None:
        """Bring the jobs in line with jobs.d: start new ones, restart changed ones, stop removed ones."""
        if self._stopping_since is not None:
            return
        previously_invalid, self.invalid = self.invalid, {}
        present: set[str] = set()
        for path, job_file in sorted(files.items()):
            existing = next((j for j in self.jobs.values() if j.file == path), None)
            if job_file.error is not None:
                self.invalid[path] = job_file.error
                if existing is not None:  # the earlier valid version keeps running
                    present.add(existing.name)
                    existing.error = job_file.error
                if previously_invalid.get(path) != job_file.error:
                    log.error("invalid job file", file=str(path), error=job_file.error)
                continue
            spec, name = job_file.spec, job_file.spec.name
            present.add(name)
            job = self.jobs.get(name)
            if job is None:
                job = self.jobs[name] = Job(spec, path, self.paths, self, self.metrics,
                                            stop_timeout=self.settings.job_stop_timeout_seconds, gang=self.gang,
                                            memory_budget=self.memory_budget, forkserver=self.forkserver)
                job.digest = job_file.digest
                if self.notice is not None:  # this host is going away: do not start anything
                    job.preempt(self.settings.preemption_deadline_seconds)
                elif not job.held:
                    self._guard(job.start, job)
            elif job.digest != job_file.digest:
                job.digest, job.error = job_file.digest, None
                log.info("job file changed; restarting with the new spec", job=name)
                self._guard(lambda: job.replace_spec(spec, path), job)
            else:
                if job.error is not None and job.error == previously_invalid.get(path):
                    job.error = None  # the file is valid again; a failure's own explanation stays
                if job.state is State.STOPPED and job.stop_reason == "removed" and not job.held:
                    log.info("job file is back; starting", job=name)
                    self._guard(job.start, job)
        for name, job in self.jobs.items():
            if name not in present and job.state not in (State.STOPPED, State.STOPPING):
                log.info("job file removed; checkpointing and stopping", job=name)
                job.stop("removed")

    def refusal(self, loaded: LoadedSpec) -> str | None:
        """Why a valid spec may not run under this daemon's settings (`tpud run` asks before it starts)."""
        return refusal(loaded, self.settings, self.paths.config)

    # --- preemption notices (from the metadata watcher's threads, posted to the loop) ---

    def on_notice(self, notice: Notice) -> None:
        if notice.kind != "clear":
            self.metrics.preemption_notice(notice.source)
        deadline = self.settings.preemption_deadline_seconds
        log.warning("maintenance notice", source=notice.source, kind=notice.kind, value=notice.value)
        if notice.kind in ("preemption", "terminate"):
            self.notice = notice
            for job in self.jobs.values():
                self._guard(lambda job=job: job.preempt(deadline), job)
        elif notice.kind in ("migrate", "upcoming"):
            for job in self.jobs.values():
                if job.state in (State.RUNNING, State.CHECKPOINTING):
                    self._guard(lambda job=job: job.checkpoint_now(deadline_s=deadline), job)
        elif notice.kind == "clear" and self.notice is not None and self.notice.source == notice.source:
            self.notice = None
            for job in self.jobs.values():
                self._guard(job.notice_cleared, job)

    # --- control requests (control thread) ---

    def handle_control(self, request: dict) -> dict:
        command = request["command"]
        if command == "status":
            if request.get("gang"):
                return self.call(lambda: self.gang_status(request.get("jobs") or []))
            return self.call(lambda: self.status(request.get("jobs") or []))
        if command == "checkpoint_now":
            return self._checkpoint_now(request.get("jobs") or [], bool(request.get("wait", True)),
                                        float(request.get("timeout") or 600))
        if command in ("stop", "start"):
            return self.call(lambda: self._stop_start(command, request.get("job")))
        raise ControlError("bad_request", f"unknown command {command!r}")

    def _job(self, name: str) -> Job:
        job = self.jobs.get(name)
        if job is None:
            raise ControlError("unknown_job", f"no job named {name!r}")
        return job

    def status(self, names: list[str]) -> dict:
        jobs = [self._job(n).snapshot() for n in names] if names else [j.snapshot() for j in self.jobs.values()]
        if not names:
            jobs += [{"name": path.stem, "state": "INVALID", "file": str(path), "error": error, "step": None,
                      "max_steps": None, "loss": None, "tokens_per_second": None, "mfu": None, "restarts": 0,
                      "last_checkpoint": None, "age_seconds": None, "goodput": None, "warnings": []}
                     for path, error in self.invalid.items()
                     if not any(j.file == path for j in self.jobs.values())]
        if self.remote_jobs is None:
            return {"jobs": jobs}
        remote = self.remote_jobs.status()
        for job in jobs:  # a remote job is shown by its URL and the generation this host runs
            if job.get("file") and Path(job["file"]).parent == self.remote_jobs.mirror:
                name = Path(job["file"]).name
                job["file"] = f"{remote['url'].rstrip('/')}/{name}#{remote['generations'].get(name, '?')}"
        return {"jobs": jobs, "remote_jobs": remote}

    def gang_status(self, names: list[str]) -> dict:
        """`tpud status --gang`: for each job spanning hosts, a row per host (tpud/gang/board.py)."""
        jobs = [self._job(n) for n in names] if names else list(self.jobs.values())
        now = time.time()
        return {"gangs": [gang_rows(job.snapshot(), self.boards.get(job.name), now)
                          for job in jobs if job.gang.place is not None]}

    def _stop_start(self, command: str, name: str) -> dict:
        job = self._job(name)
        if command == "stop":
            if job.state in (State.STOPPED, State.SUCCEEDED, State.FAILED):
                raise ControlError("not_running", f"job {name} is {job.state.value}")
            job.held = True
            job.stop("stop")
        else:
            if self._stopping_since is not None:
                raise ControlError("not_running", "the daemon is shutting down")
            job.held = False
            job.start()
        return {"job": name, "state": job.state.value}

    def _checkpoint_now(self, names: list[str], wait: bool, timeout: float) -> dict:
        def request() -> dict[str, Future]:
            chosen = [self._job(n) for n in names] if names else [j for j in self.jobs.values() if j.active]
            if names:
                for job in chosen:
                    if job.state not in (State.RUNNING, State.CHECKPOINTING):
                        raise ControlError("not_running", f"job {job.name} is {job.state.value}")
            return {job.name: job.checkpoint_now(deadline_s=None) for job in chosen}

        futures = self.call(request)
        if not wait:
            return {"results": [{"job": name, "ok": True, "requested": True} for name in futures]}
        deadline = time.monotonic() + timeout
        results = []
        for name, future in futures.items():
            try:
                results.append(future.result(max(0.0, deadline - time.monotonic())))
            except FutureTimeout:
                results.append({"job": name, "ok": False, "error": f"no commit within {timeout:.0f}s"})
            except Exception as e:
                results.append({"job": name, "ok": False, "error": str(e)})
        return {"results": results}

    # --- the loop ---

    def _guard(self, fn: Callable[[], None], job: Job | None = None) -> None:
        """Nothing a worker sends or a file says may take the daemon (and every job) down."""
        try:
            fn()
        except Exception as e:
            log.exception("internal error handled; the daemon carries on", job=job.name if job else None,
                          error=repr(e))
            if job is not None:
                try:
                    job.fail(f"internal error: {e!r}")
                except Exception:  # the job's own recovery failed too: it stays as it is, the daemon runs on
                    log.exception("cannot fail the job after an internal error", job=job.name)

    def post(self, fn: Callable[[], None]) -> None:
        """Run fn on the loop thread soon (from any thread, without waiting)."""
        self._calls.put((lambda: self._guard(fn), Future()))
        self.wake()

    def _select_timeout(self) -> float:
        """At most TICK_S, less when a job's timer (backoff, kill, hang) is due sooner."""
        now = time.monotonic()
        due = [t for job in self.jobs.values() if (t := job.next_timer()) is not None]
        return min([TICK_S, *(max(0.0, t - now) + 0.001 for t in due)])

    def _on_signal(self, signum: int, frame) -> None:
        self._signals.append(signum)

    def _summary(self) -> str:
        counts: dict[str, int] = {}
        for job in self.jobs.values():
            counts[job.state.value] = counts.get(job.state.value, 0) + 1
        states = ", ".join(f"{n} {s.lower()}" for s, n in sorted(counts.items())) or "no jobs"
        return f"{len(self.jobs)} jobs: {states}" + (f"; {len(self.invalid)} invalid" if self.invalid else "")

    def _begin_shutdown(self) -> None:
        self._stopping_since = time.monotonic()
        self.notifier.stopping("checkpointing every job before exit")
        self.notifier.extend_timeout(self.settings.stop_budget_seconds)
        for job in self.jobs.values():
            # The VM's shutdown path: it may be a preemption whose notice we never saw.
            job.stop("shutdown", deadline_s=self.settings.preemption_deadline_seconds)

    def _shutdown_done(self) -> bool:
        if any(job.active for job in self.jobs.values()):
            if time.monotonic() - self._stopping_since < self.settings.stop_budget_seconds:
                return False
            log.error("stop budget spent; killing the remaining workers")
            for job in self.jobs.values():
                if job.worker is not None:
                    job.worker.signal(signal.SIGKILL)
            return False if any(job.worker is not None for job in self.jobs.values()) else True
        return True

    def run(self) -> int:
        with contextlib.ExitStack() as services:
            metrics_at = self._start_services(services)
            log.info("tpud started", version=__version__, jobs_dir=None if self.single else str(self.paths.jobs_dir),
                     metrics=metrics_at, control=str(self.paths.runtime / "control.sock"),
                     gang=None if self.gang is None else f"host {self.gang.host} of {self.gang.hosts}, coordinator "
                     f"{','.join(self.gang.addresses)}")
            if self.coordinator is not None:  # before any job: the workers meet there
                self.coordinator.ensure()
            if self.single is None:
                self._on_files_changed()  # the first scan; jobs start as its result arrives
            else:
                self._start_single()
            self.notifier.ready(self._summary())
            self._loop()
            self._close_jobs()
            log.info("tpud stopped")
            return self._exit_status()

    def _start_services(self, services: contextlib.ExitStack) -> str:
        """Everything the loop serves, each closed by `services` (in reverse) however the daemon ends:
        metrics, the metadata watcher, the control socket, the jobs directory's watcher and reader,
        the signal handlers. The metrics listener's address."""
        for directory in (self.paths.jobs_dir, self.paths.state, self.paths.runtime):
            directory.mkdir(parents=True, exist_ok=True)
        services.callback(self.metrics.close)
        host, port = self.metrics.serve(self.metrics_addr)
        write_address_file(self.paths.runtime / "metrics.addr", host, port)
        if self.view is not None:
            self.view.metrics_address = f"{host}:{port}"
        if self.single is None:
            self.offloop = OffLoop(self.post)
            services.callback(self.offloop.close)
            control = ControlServer(self.paths.runtime / "control.sock", self.handle_control)
            services.callback(control.close)
            services.callback(self._refuse_calls)  # before it closes, should the setup fail from here
            control.start()
            watcher = Watcher(self.paths.jobs_dir, self._on_files_changed, rescan_s=self.settings.rescan_seconds)
            services.callback(watcher.stop)
            watcher.start()
            if self.settings.remote_jobs is not None:
                self.remote_jobs = RemoteJobs(self.settings.remote_jobs, self.paths.remote_jobs, self._on_files_changed,
                                              poll_s=self.settings.remote_jobs_poll_seconds)
                services.callback(self.remote_jobs.stop)
                self.remote_jobs.start()
        if self.coordinator is not None:
            services.callback(self.coordinator.close)
        services.callback(self.forkserver.close)
        services.callback(self.boards.close)
        settings = self.settings
        metadata = MetadataWatcher(
            lambda notice: self.post(lambda: self.on_notice(notice)), host=resolve_host(settings.metadata_host),
            timeout_sec=settings.metadata_timeout_seconds,
            upcoming_poll_seconds=settings.upcoming_maintenance_poll_seconds)
        services.callback(metadata.stop)
        metadata.start()
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        previous_wakeup = signal.set_wakeup_fd(self._wake_w)
        services.callback(lambda: [signal.signal(s, handler) for s, handler in previous.items()])
        services.callback(signal.set_wakeup_fd, previous_wakeup)
        services.callback(self._refuse_calls)
        self.watch(self._wake_r, self._drain_wake)
        return f"{host}:{port}"

    def _refuse_calls(self) -> None:
        """The loop has ended: what was asked of it meanwhile is refused, not left waiting."""
        self._loop_done = True
        while not self._calls.empty():
            _, future = self._calls.get()
            future.set_exception(ControlError("not_running", "the daemon is shutting down"))

    def _loop(self) -> None:
        """The main loop: I/O callbacks, calls posted from other threads, recorded signals, then every
        job's tick, until a stop has checkpointed every job (or `tpud run`'s job has ended)."""
        last_status = ""
        while True:
            for key, _ in self.selector.select(self._select_timeout()):
                # An earlier callback of this same batch may have released this object.
                if self.selector.get_map().get(key.fd) is key:
                    self._guard(key.data)
            self._run_posted()
            self._act_on_signals()
            self._tick()
            if (summary := self._summary()) != last_status:
                self.notifier.status(summary)
                last_status = summary
            if self._stopping_since is not None and self._shutdown_done():
                return
            if self.single is not None and not any(job.active or job.state is State.BACKOFF
                                                   for job in self.jobs.values()):
                self._stopping_since = time.monotonic()
                return

    def _run_posted(self) -> None:
        while not self._calls.empty():
            fn, future = self._calls.get()
            try:
                future.set_result(fn())
            except Exception as e:
                future.set_exception(e)

    def _act_on_signals(self) -> None:
        """The signals the handler recorded: SIGHUP reloads; a first stop checkpoints every job, a
        second one kills the workers."""
        while self._signals:
            signum = self._signals.pop(0)
            if signum == signal.SIGHUP:
                log.info("reloading settings and rescanning jobs")
                self._reload()
            elif self._stopping_since is None:
                log.info("stopping: checkpointing every job", signal=signal.Signals(signum).name)
                if signum == signal.SIGTERM:
                    self.metrics.preemption_notice("sigterm")
                self._begin_shutdown()
            else:
                log.warning("second stop signal: killing the workers")
                for job in self.jobs.values():
                    if job.worker is not None:
                        job.worker.signal(signal.SIGKILL)

    def _tick(self) -> None:
        if self.coordinator is not None:
            self._guard(self.coordinator.ensure)
        self._guard(self.forkserver.tick)
        for job in list(self.jobs.values()):
            self._guard(job.tick, job)
            if self.view is not None:
                self.view.update(job.snapshot)
        self._guard(lambda: self.boards.tick(list(self.jobs.values())))
        self.notifier.watchdog()

    def _close_jobs(self) -> None:
        """Within what is left of the stop budget: every job's uploads finished, then the jobs closed."""
        def remaining() -> float:
            return max(1.0, self.settings.stop_budget_seconds - (time.monotonic() - self._stopping_since))

        for job in self.jobs.values():
            if job.tiers.uploader is not None and not job.tiers.uploader.close(timeout=remaining()):
                log.error("stop budget spent before every upload finished", job=job.name)
        for job in self.jobs.values():
            job.close(timeout=remaining())

    def _exit_status(self) -> int:
        """The daemon exits 0; `tpud run` exits with its worker's last status (0 for a gang's job
        found finished, with no worker started)."""
        if self.single is None:
            return 0
        (job,) = self.jobs.values()
        if job.last_status is None:
            return 0 if job.state is State.SUCCEEDED else 1
        return job.last_status

