"""Run one job's worker as a child process, relay its output, and stop it cleanly.

supervisord's discipline: signal handlers only record what arrived (and wake the loop
through set_wakeup_fd); the main loop decides what to do. The worker runs in its own
process group so a terminal's Ctrl-C reaches only the supervisor, which then asks the
worker to checkpoint and stop at its next boundary; a second signal kills it.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
from pathlib import Path
from typing import BinaryIO

import structlog

from engine.config import JobSpec
from tpud.gcs import GcsTier, RemoteError
from tpud.paths import Paths
from tpud.uploader import Uploader, ensure_newest_local

log = structlog.get_logger()

# Variables that belong to the supervisor's own service manager, never to a worker.
_SCRUBBED_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID")


def worker_env(log_format: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV}
    env.update(PYTHONUNBUFFERED="1", TPUD_LOG_FORMAT=log_format, TPUD_SUPERVISOR_PID=str(os.getpid()))
    return env


def exit_status(returncode: int) -> int:
    """A shell-style status: a worker killed by signal N reports 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


class WorkerProcess:
    """One running worker: `python -m tpud.worker SPEC.json`, output on a pipe."""

    def __init__(self, spec: JobSpec, paths: Paths, log_format: str, extra_env: dict[str, str] | None = None):
        job_dir = paths.job_dir(spec.name)
        job_dir.mkdir(parents=True, exist_ok=True)
        spec_file = job_dir / "spec.json"
        # Only what the job file set: a full dump would also set keys that some sections reject
        # as meaningless for the chosen option (e.g. wsd-only keys under a cosine schedule).
        spec_file.write_text(spec.model_dump_json(indent=2, by_alias=True, exclude_unset=True))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tpud.worker", str(spec_file), "--state-dir", str(paths.state)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**worker_env(log_format), **(extra_env or {})}, start_new_session=True,
        )
        self.pid = self.proc.pid
        os.set_blocking(self.proc.stdout.fileno(), False)

    def signal(self, signum: int) -> None:
        try:
            os.killpg(self.pid, signum)  # the whole group: helpers the worker spawned too
        except ProcessLookupError:
            pass

    @property
    def stdout(self) -> BinaryIO:
        return self.proc.stdout

    def wait(self) -> int:
        return exit_status(self.proc.wait())


class CheckpointTiers:
    """The supervisor's side of checkpoints: the GCS tier, when the job has one.

    It lives here rather than in the worker so that an upload outlives a worker crash.
    """

    def __init__(self, spec: JobSpec, paths: Paths):
        self.local_job_dir = Path(spec.checkpoint.dir or paths.state / "checkpoints") / spec.name
        self.tier = GcsTier.for_spec(spec)
        self.uploader = Uploader(self.tier, self.local_job_dir, spec.checkpoint.keep) if self.tier else None

    def prepare(self) -> None:
        """Before a worker starts: bring the newest committed step here if only GCS has it."""
        if self.tier:
            self.local_job_dir.mkdir(parents=True, exist_ok=True)
            ensure_newest_local(self.tier, self.local_job_dir)
            self.uploader.start()

    def on_worker_line(self, line: bytes) -> None:
        if self.uploader is None or b"checkpoint committed" not in line:
            return
        try:
            record = json.loads(line)
        except ValueError:
            return
        if record.get("event") == "checkpoint committed":
            self.uploader.submit(Path(record["path"]))

    def close(self) -> bool:
        """Wait for pending uploads; True when everything committed locally is also remote."""
        return self.uploader.close(timeout=None) if self.uploader else True


def run_foreground(spec: JobSpec, paths: Paths, out: BinaryIO | None = None) -> int:
    """Run the job's worker to completion; returns its exit status."""
    out = out or sys.stdout.buffer
    # The worker's log is parsed for checkpoint events, so it is JSON whatever the terminal.
    tiers = CheckpointTiers(spec, paths)
    log_format = "console" if os.isatty(out.fileno()) and tiers.tier is None else "json"
    try:
        tiers.prepare()
    except RemoteError as e:
        log.error("cannot reach the GCS tier to find the newest checkpoint; not starting", error=str(e))
        return 1
    received: list[int] = []
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    previous = {s: signal.signal(s, lambda signum, frame: received.append(signum))
                for s in (signal.SIGINT, signal.SIGTERM)}
    previous_wakeup = signal.set_wakeup_fd(wake_w)
    try:
        worker = WorkerProcess(spec, paths, log_format)
        log.info("worker started", job=spec.name, pid=worker.pid, state_dir=str(paths.state))
        selector = selectors.DefaultSelector()
        selector.register(worker.stdout, selectors.EVENT_READ)
        selector.register(wake_r, selectors.EVENT_READ)
        stops_sent, partial = 0, b""
        while True:
            for key, _ in selector.select():
                if key.fileobj == wake_r:
                    os.read(wake_r, 512)
                    continue
                chunk = worker.stdout.read(65536)
                if not chunk:  # EOF: the worker and everything it spawned closed the pipe
                    status = worker.wait()
                    log.info("worker exited", job=spec.name, status=status)
                    if not tiers.close():
                        log.error("some checkpoints were not uploaded", job=spec.name)
                    return status
                out.write(chunk)
                out.flush()
                *lines, partial = (partial + chunk).split(b"\n")
                for line in lines:
                    tiers.on_worker_line(line)
            while received:
                signum = received.pop(0)
                stops_sent += 1
                if stops_sent == 1:
                    log.info("stopping worker: checkpoint, then exit", signal=signal.Signals(signum).name)
                    worker.signal(signal.SIGTERM)
                else:
                    log.warning("second stop signal: killing the worker")
                    worker.signal(signal.SIGKILL)
    finally:
        signal.set_wakeup_fd(previous_wakeup)
        for s, handler in previous.items():
            signal.signal(s, handler)
        os.close(wake_r)
        os.close(wake_w)


def die_with_parent(expected_parent: int | None) -> None:
    """Linux: SIGKILL this process when its supervisor dies, so no worker is orphaned."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)  # the supervisor died before prctl took effect

