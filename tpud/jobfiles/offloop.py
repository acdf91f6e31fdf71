"""Reading jobs.d and tpud.yaml away from the daemon's loop, in a helper process.

The loop answers `tpud status` and pings systemd's watchdog. Parsing a job file is bounded
(engine.spec.loader.LIMITS) but can still take a second of CPU for a large or hostile one, and
a directory may hold many. Parsed on a thread of the daemon, that CPU time would hold the
daemon's GIL (measured: `status` answers stalled past 100 ms beside a busy worker); parsed
in a child process it costs the daemon neither time nor memory, and a read that runs away
can be killed. The child is spawned (the daemon has threads; forking it would be unsafe),
imports only the torch-free job-file modules, dies with the daemon, and is started again
after a crash or a timeout.

One reader thread sends the reads to the child, first come first served, and hands each
result to the loop in the order the reads ran; a read asked for again before it started
runs once. It is a daemon thread: nothing here holds up the daemon's exit.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.pool
import os
import queue
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from engine.spec.loader import LoadedSpec
from tpud.jobfiles.reading import JobFile, scan
from tpud.settings import Settings, load_settings

log = structlog.get_logger()
READ_TIMEOUT_S = 120.0  # a whole jobs.d; each file is bounded, so only thousands of files come near


# --- what runs in the helper process (module-level: the calls are pickled) ---


def refusal(loaded: LoadedSpec, settings: Settings, config_dir: Path) -> str | None:
    """Why a valid spec may not run under these settings, as FILE:LINE: KEY: MESSAGE."""
    if loaded.spec.debug.inject is None or settings.allow_fault_injection:
        return None
    return str(loaded.problem("debug.inject", "fault injection is refused: set allow_fault_injection: true "
                                              f"in {config_dir / 'tpud.yaml'} to allow it"))


def read_jobs(jobs_dir: Path, settings: Settings, config_dir: Path) -> dict[Path, JobFile]:
    """jobs.d as it is now, a valid job these settings refuse counted as invalid."""
    files = scan(jobs_dir)
    for path, job_file in files.items():
        if job_file.spec is not None and (refused := refusal(job_file.loaded, settings, config_dir)):
            files[path] = JobFile.invalid(path, job_file.digest, refused)
    return files


@dataclass(frozen=True)
class Reloaded:
    settings: Settings
    error: str | None
    files: dict[Path, JobFile]


def reload(jobs_dir: Path, config_dir: Path) -> Reloaded:
    """SIGHUP: tpud.yaml again, then jobs.d under the new settings."""
    settings, error = load_settings(config_dir)
    return Reloaded(settings, error, read_jobs(jobs_dir, settings, config_dir))


def _child_init(daemon_pid: int) -> None:
    from tpud.worker.process import die_with_parent  # torch-free at import

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the daemon's to handle
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    die_with_parent(daemon_pid)


# --- the daemon's side ---


class _Helper:
    """The child process; started on first use, started again after a crash or a timeout."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._pool: multiprocessing.pool.Pool | None = None

    def call(self, fn: Callable[..., Any], args: tuple) -> Any:
        if self._pool is None:
            context = multiprocessing.get_context("spawn")
            self._pool = context.Pool(1, initializer=_child_init, initargs=(os.getpid(),))
        try:
            return self._pool.apply_async(fn, args).get(self.timeout)
        except multiprocessing.TimeoutError:
            log.error("reading job files took too long (or the reader died); restarting the reader",
                      timeout_s=self.timeout)
            self.close()
            raise

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.terminate()
            pool.join()


@dataclass(frozen=True)
class _Task:
    name: str
    fn: Callable[..., Any]
    args: Callable[[], tuple]    # evaluated on the reader thread, just before the call
    then: Callable[[Any], None]  # on the loop, with the result
    seen: Callable[[Any], None] | None = None  # on the reader thread, before later reads run


class OffLoop:
    def __init__(self, post: Callable[[Callable[[], None]], None], timeout: float = READ_TIMEOUT_S):
        """`post(fn)` runs fn on the loop thread (the daemon's post)."""
        self._post = post
        self._helper = _Helper(timeout)
        self._tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._queued: set[str] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="tpud-reader", daemon=True)
        self._thread.start()

    def submit(self, name: str, fn: Callable[..., Any], args: Callable[[], tuple], then: Callable[[Any], None],
               seen: Callable[[Any], None] | None = None) -> None:
        """Run `fn(*args())` in the helper process, then `then(result)` on the loop; a no-op
        while a read named `name` waits to start. `fn` must be a module-level function."""
        with self._lock:
            if self._closed or name in self._queued:
                return
            self._queued.add(name)
        self._tasks.put(_Task(name, fn, args, then, seen))

    def _run(self) -> None:
        while (task := self._tasks.get()) is not None:
            with self._lock:
                self._queued.discard(task.name)
            try:
                result = self._helper.call(task.fn, task.args())
            except Exception:  # noqa: BLE001 - a strange file must never stop later reads
                log.exception("background read failed", read=task.name)
                continue
            if task.seen is not None:
                task.seen(result)
            self._post(lambda task=task, result=result: task.then(result))
        self._helper.close()

    def close(self) -> None:
        """Start nothing more; the helper process ends once a read in progress is done."""
        with self._lock:
            self._closed = True
        self._tasks.put(None)
