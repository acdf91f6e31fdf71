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
from pathlib import Path
from typing import BinaryIO, Protocol

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


def exit_status(returncode: int) -> int:
    """A shell-style status: a worker killed by signal N reports 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


class Forker(Protocol):
    """What starts a worker warm (tpud/worker/forkserver.py's ForkServer): a Popen-like process, or None."""

    def fork(self, argv: list[str], env: dict[str, str]): ...


class WorkerProcess:
    """One running worker, `python -m tpud.worker SPEC.json --state-dir DIR`, output on a pipe:
    forked by the daemon's fork server when one is given and warm, else started cold."""

    def __init__(self, spec: JobSpec, paths: Paths, log_format: str, extra_env: dict[str, str] | None = None,
                 *, forkserver: Forker | None = None):
        self.spec_file = paths.layout.spec_file(spec.name)
        # Only what the job file set: a full dump would also set keys that some sections reject
        # as meaningless for the chosen option (e.g. wsd-only keys under a cosine schedule).
        atomic_write(self.spec_file, spec.model_dump_json(indent=2, by_alias=True, exclude_unset=True))
        argv = [str(self.spec_file), "--state-dir", str(paths.state)]
        env = {**worker_env(log_format), **(extra_env or {})}
        self.proc = forkserver.fork(argv, env) if forkserver is not None else None
        self.forked = self.proc is not None
        if self.proc is None:
            self.proc = subprocess.Popen([sys.executable, "-m", "tpud.worker", *argv], stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        self.pid = self.proc.pid
        os.set_blocking(self.proc.stdout.fileno(), False)

    def signal(self, signum: int) -> None:
        try:
            os.killpg(self.pid, signum)  # the whole group: helpers the worker spawned too
        except ProcessLookupError:
            try:  # forked an instant ago, it may not lead its own group yet
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def stopped(self) -> bool:
        return process_stopped(self.pid)

    @property
    def stdout(self) -> BinaryIO:
        return self.proc.stdout

    def wait(self) -> int:
        """Its exit status, once its output has ended."""
        status = exit_status(self.proc.wait())
        self.proc.stdout.close()
        return status


def die_with_parent(expected_parent: int | None) -> None:
    """Linux: SIGKILL this process when its supervisor dies, so no worker is orphaned."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)  # the supervisor died before prctl took effect
