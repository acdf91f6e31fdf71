"""A job's current worker processes, while it has them: one per host, or several that shard the
model among themselves (device.processes_per_host), forked warm or started cold, each with its
channel, output and hang watch; the requests sent to them, and the signals that end them when
asked to stop too slowly or judged hung. They live and die together: the first to fail takes
the others down (they would wait for it in a collective), and the job hears one exit, the
first failure's (or local rank 0's). What that exit means is the job's to decide (job.py)."""

from __future__ import annotations

import functools
import signal
from collections.abc import Callable
from pathlib import Path

import structlog

from engine import events, exit_codes
from engine.requests import Request
from engine.spec.schema import JobSpec
from tpud.children import ranks
from tpud.children.process import WorkerProcess
from tpud.job.health import crashes
from tpud.job.health.hang import HangWatch
from tpud.job.output import WorkerOutput
from tpud.job.routing import handler_name
from tpud.worker import channel

log = structlog.get_logger()

CLEAN = (exit_codes.OK, exit_codes.STOPPED)  # every process exits so together; any other takes the rest down


class CurrentWorker:
    def __init__(self, job: str, channel_path: Path, loop, spawn: Callable[[JobSpec, dict[str, str]], WorkerProcess],
                 watch: HangWatch, *, on_event: Callable[[events.Event], None], on_exit: Callable[[int], None]):
        """spawn(spec, env) starts a worker process; on_exit(status) once all of them exited. `watch`
        is local rank 0's, the job's; the others' events only keep their own watches."""
        self.job, self.channel_path, self.loop, self.spawn, self.watch = job, channel_path, loop, spawn, watch
        self.on_event, self.on_exit = on_event, on_exit
        self.processes: list[WorkerProcess] = []
        self.links: list[channel.Link] = []
        self.outputs = [WorkerOutput(loop.relay)]
        self.watches = [watch]
        self.exits: dict[int, int] = {}  # local rank -> status, in the order they exited
        self.kill_at: float | None = None  # the clock time to SIGKILL them by
        self.hang: str | None = None  # why they were judged hung
        self._oom_kills: int | None = None

    @property
    def process(self) -> WorkerProcess | None:
        """Local rank 0, while any of the processes runs: its pid is the job's in status."""
        return self.processes[0] if self.processes else None

    @property
    def output(self) -> WorkerOutput:
        """The output that explains the exit: the first failed process's, else local rank 0's."""
        return self.outputs[self._culprit()]

    def start(self, spec: JobSpec, extra_env: dict[str, str], processes: int = 1) -> int:
        """Start the worker processes; local rank 0's pid."""
        port = ranks.free_port() if processes > 1 else None
        self._oom_kills = crashes.oom_kill_count()
        self.hang, self.exits = None, {}
        self.outputs = self.outputs[:1] + [WorkerOutput(self.loop.relay) for _ in range(1, processes)]
        self.watches = self.watches[:1] + [HangWatch(spec.health, self.watch.clock) for _ in range(1, processes)]
        for local in range(processes):
            # "@" is never in a job name: local rank 1 of job "a" is not job "a.1".
            path = self.channel_path if local == 0 else self.channel_path.with_name(f"{self.job}@{local}.sock")
            on_event = self.on_event if local == 0 else functools.partial(_keep_watch, self.watches[local])
            self.watches[local].new_worker(spec.health)
            self.links.append(channel.Link(path, self.loop, on_event))
            self.outputs[local].new_worker()
            env = {"TPUD_CHANNEL": str(path), **extra_env, **ranks.local_env(local, processes, port)}
            process = self.spawn(spec, env)
            self.processes.append(process)
            self.loop.watch(process.stdout, functools.partial(self._on_output, local))
            log.info("worker started", job=self.job, pid=process.pid, forked=process.forked,
                     **({"local_rank": local} if processes > 1 else {}))
        return self.processes[0].pid

    def request(self, request: Request, fallback: int) -> None:
        for process, link in zip(self.processes, self.links):
            if not link.send(events.CheckpointRequest.of(request)):
                process.signal(fallback)  # the signal fallback: same meaning, next boundary

    def signal(self, signum: int) -> None:
        for process in self.processes:
            process.signal(signum)

    def _on_output(self, local: int) -> None:
        process = self.processes[local]
        chunk = process.stdout.read(65536)
        if chunk:
            self.outputs[local].feed(chunk)
            return
        self.outputs[local].ended()
        self.loop.unwatch(process.stdout)
        status = self.exits[local] = process.wait()
        if len(self.exits) == len(self.processes):
            self.on_exit(self.exits[self._culprit()])
        elif status not in CLEAN:
            log.warning("a worker process failed; ending the job's others", job=self.job, local_rank=local,
                        status=status)
            self.signal(signal.SIGKILL)

    def _culprit(self) -> int:
        """The local rank whose exit is the job's: the first that failed, else local rank 0."""
        return next((local for local, status in self.exits.items() if status not in CLEAN), 0)

    def release(self) -> None:
        """They all exited."""
        for link in self.links:
            link.close()
        self.links, self.processes, self.kill_at = [], [], None

    def crash(self, status: int) -> crashes.Crash:
        """Why it died, from its exit status, its output's tail and the kernel's OOM kills."""
        return crashes.classify(status, list(self.output.tail), oom_kills_before=self._oom_kills,
                                oom_kills_after=crashes.oom_kill_count())

    def tick(self, now: float, kill_grace_s: float, gang: bool) -> None:
        """Kill them when a stop ran past its deadline; end them when one is hung."""
        if self.kill_at is not None and now >= self.kill_at and self.processes:
            log.warning("worker did not stop in time; killing it", job=self.job)
            self.signal(signal.SIGKILL)
            self.kill_at = None
        if self.processes and self.hang is None and self.kill_at is None:
            hung, self.hang = next(((w, why) for w in self.watches if (why := w.verdict(now)) is not None),
                                   (None, None))
            if hung is not None:
                log.error("worker hung; terminating it", job=self.job, silent_s=round(now - hung.last_heard, 3),
                          bound_s=round(hung.bound(), 3), step=hung.step, local_rank=self.watches.index(hung))
                # Stopped by a signal, SIGTERM would wait for a SIGCONT. In a gang, or beside processes
                # of its own host, no checkpoint can be taken without the hung one: its death ends the
                # others' wait soonest.
                if gang or len(self.processes) > 1 or any(p.stopped() for p in self.processes):
                    self.signal(signal.SIGKILL)
                else:
                    self.signal(signal.SIGTERM)  # a worker that is merely slow still checkpoints and exits
                    self.kill_at = now + kill_grace_s

    def timers(self) -> list[float | None]:
        """When tick() next has something to do."""
        if self.processes and self.hang is None and self.kill_at is None:
            return [watch.deadline() for watch in self.watches[:len(self.processes)]]
        return [self.kill_at]


def _keep_watch(watch: HangWatch, event: events.Event) -> None:
    """A process other than local rank 0: its events say only that it lives, and where it stands."""
    if (handler := getattr(watch, handler_name(type(event)), None)) is not None:
        handler(event)
