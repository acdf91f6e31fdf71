"""A worker process, as the supervisor sees it.

The worker runs in its own session and process group (a terminal's Ctrl-C reaches only the
supervisor, which then asks the worker to checkpoint and stop) and dies with its
supervisor (parent-death signal), so no worker is ever orphaned.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import BinaryIO

import structlog

from engine.spec.schema import JobSpec
from engine.layout import atomic_write
from tpud.paths import Paths

log = structlog.get_logger()

# Variables that belong to the supervisor's own service manager, never to a worker.
_SCRUBBED_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID")


def worker_env(log_format: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV}
    env.update(PYTHONUNBUFFERED="1", TPUD_LOG_FORMAT=log_format, TPUD_SUPERVISOR_PID=str(os.getpid()))
    return env


def process_stopped(pid: int) -> bool:
    """Stopped by a signal (SIGSTOP, SIGTSTP): it cannot act on SIGTERM until continued."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] == "T"


def set_session_nice(pid: int, nice: int) -> None:
    """Weigh pid's session (a worker is a session leader) for the CPU scheduler.

    With sched_autogroup (the default outside a cpu cgroup), the scheduler shares CPU fairly
    between sessions first: a thread's own nice value only counts within its session.
    """
    path = Path(f"/proc/{pid}/autogroup")
    for _ in range(10):
        try:
            path.write_text(str(nice))
            return
        except BlockingIOError:  # unprivileged writes are rate-limited to one per 100 ms
            time.sleep(0.02)
        except OSError:  # no autogroup support, or the process is gone
            return


def exit_status(returncode: int) -> int:
    """A shell-style status: a worker killed by signal N reports 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


class WorkerProcess:
    """One running worker: `python -m tpud.worker SPEC.json`, output on a pipe.

    A standby worker (`--standby`) imports torch and the engine at the lowest CPU priority,
    then waits for release() before it reads its spec and trains: a warm spare, so that a
    restart skips the seconds of imports.
    """

    def __init__(self, spec: JobSpec, paths: Paths, log_format: str, extra_env: dict[str, str] | None = None,
                 *, standby: bool = False):
        self.spec_file = paths.layout.spec_file(spec.name)
        self.write_spec(spec)
        self.extra_env = extra_env or {}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tpud.worker", str(self.spec_file), "--state-dir", str(paths.state),
             *(["--standby"] if standby else [])],
            stdin=subprocess.PIPE if standby else subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, env={**worker_env(log_format), **self.extra_env}, start_new_session=True,
        )
        self.pid = self.proc.pid
        # Readable once it exits (a pidfd): how a warm spare's death is seen before anyone reads its output.
        self.sentinel: int | None = os.pidfd_open(self.pid)
        os.set_blocking(self.proc.stdout.fileno(), False)
        if standby:
            set_session_nice(self.pid, 19)

    def write_spec(self, spec: JobSpec) -> None:
        # Only what the job file set: a full dump would also set keys that some sections reject
        # as meaningless for the chosen option (e.g. wsd-only keys under a cosine schedule).
        # Atomically: a released standby may be reading it as its successor's spawn writes it.
        atomic_write(self.spec_file, spec.model_dump_json(indent=2, by_alias=True, exclude_unset=True))

    def release(self, spec: JobSpec) -> bool:
        """Let a standby worker train `spec`; False if it has already exited (then it is reaped)."""
        if self.proc.poll() is not None:
            return False
        self.write_spec(spec)
        set_session_nice(self.pid, 0)
        try:
            self.proc.stdin.write(b"go\n")
            self.proc.stdin.close()
        except BrokenPipeError:
            self.discard()
            return False
        return True

    def discard(self) -> int:
        """End a standby worker that is no longer wanted (or that died): its exit status."""
        if self.proc.poll() is None:  # (once reaped, its pid may belong to another process)
            self.signal(signal.SIGKILL)
        status = self.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None and not pipe.closed:
                try:
                    pipe.close()
                except BrokenPipeError:
                    pass
        return status

    def signal(self, signum: int) -> None:
        try:
            os.killpg(self.pid, signum)  # the whole group: helpers the worker spawned too
        except ProcessLookupError:
            pass

    def stopped(self) -> bool:
        return process_stopped(self.pid)

    @property
    def stdout(self) -> BinaryIO:
        return self.proc.stdout

    def wait(self) -> int:
        status = exit_status(self.proc.wait())
        if self.sentinel is not None:
            os.close(self.sentinel)
            self.sentinel = None
        return status


def die_with_parent(expected_parent: int | None) -> None:
    """Linux: SIGKILL this process when its supervisor dies, so no worker is orphaned."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)  # the supervisor died before prctl took effect
