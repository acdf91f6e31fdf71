"""A job's current worker process, while it has one: forked warm or started cold, its channel
and output, the requests sent to it, and the signals that end one asked to stop too slowly or
judged hung. What its exit means is the job's to decide (job.py)."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import structlog

from engine import events
from engine.requests import Request
from engine.spec.schema import JobSpec
from tpud.job.health import crashes
from tpud.job.health.hang import HangWatch
from tpud.job.output import WorkerOutput
from tpud.worker import channel
from tpud.children.process import WorkerProcess

log = structlog.get_logger()


class CurrentWorker:
    def __init__(self, job: str, channel_path: Path, loop, spawn: Callable[[JobSpec, dict[str, str]], WorkerProcess],
                 watch: HangWatch, *, on_event: Callable[[events.Event], None], on_exit: Callable[[int], None]):
        """spawn(spec, env) starts a worker; on_exit(status) once one exited."""
        self.job, self.channel_path, self.loop, self.spawn, self.watch = job, channel_path, loop, spawn, watch
        self.on_event, self.on_exit = on_event, on_exit
        self.process: WorkerProcess | None = None
        self.link: channel.Link | None = None
        self.output = WorkerOutput(loop.relay)
        self.kill_at: float | None = None  # the clock time to SIGKILL it by
        self.hang: str | None = None  # why it was judged hung
        self._oom_kills: int | None = None

    def start(self, spec: JobSpec, extra_env: dict[str, str]) -> int:
        """Start a worker; its pid."""
        env = {"TPUD_CHANNEL": str(self.channel_path), **extra_env}
        self.watch.new_worker(spec.health)
        self.link = channel.Link(self.channel_path, self.loop, self.on_event)
        self._oom_kills = crashes.oom_kill_count()
        self.output.new_worker()
        self.hang = None
        self.process = self.spawn(spec, env)
        self.loop.watch(self.process.stdout, self._on_output)
        log.info("worker started", job=self.job, pid=self.process.pid, forked=self.process.forked)
        return self.process.pid

    def request(self, request: Request, fallback: int) -> None:
        sent = self.link is not None and self.link.send(events.CheckpointRequest.of(request))
        if not sent and self.process is not None:
            self.process.signal(fallback)  # the signal fallback: same meaning, next boundary

    def _on_output(self) -> None:
        chunk = self.process.stdout.read(65536)
        if chunk:
            self.output.feed(chunk)
            return
        self.output.ended()
        self.loop.unwatch(self.process.stdout)
        self.on_exit(self.process.wait())

    def release(self) -> None:
        """It exited."""
        if self.link is not None:
            self.link.close()
            self.link = None
        self.process, self.kill_at = None, None

    def crash(self, status: int) -> crashes.Crash:
        """Why it died, from its exit status, its output's tail and the kernel's OOM kills."""
        return crashes.classify(status, list(self.output.tail), oom_kills_before=self._oom_kills,
                                oom_kills_after=crashes.oom_kill_count())

    def tick(self, now: float, kill_grace_s: float, gang: bool) -> None:
        """Kill it when a stop ran past its deadline; end it when it is hung."""
        if self.kill_at is not None and now >= self.kill_at and self.process is not None:
            log.warning("worker did not stop in time; killing it", job=self.job)
            self.process.signal(signal.SIGKILL)
            self.kill_at = None
        if self.process is not None and self.hang is None and self.kill_at is None:
            self.hang = self.watch.verdict(now)
            if self.hang is not None:
                log.error("worker hung; terminating it", job=self.job, silent_s=round(now - self.watch.last_heard, 3),
                          bound_s=round(self.watch.bound(), 3), step=self.watch.step)
                # Stopped by a signal, SIGTERM would wait for a SIGCONT. In a gang no checkpoint can be
                # taken without the hung worker, so the others' wait ends soonest with this one's death.
                if self.process.stopped() or gang:
                    self.process.signal(signal.SIGKILL)
                else:
                    self.process.signal(signal.SIGTERM)  # a worker that is merely slow still checkpoints and exits
                    self.kill_at = now + kill_grace_s

    def timers(self) -> list[float | None]:
        """When tick() next has something to do."""
        if self.process is not None and self.hang is None and self.kill_at is None:
            return [self.watch.deadline()]
        return [self.kill_at]
