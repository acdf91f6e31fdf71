"""Reading jobs.d and tpud.yaml away from the daemon's loop, in a helper process.

The loop answers `tpud status` and pings systemd's watchdog. Parsing a job file is bounded
(engine.spec.loader.LIMITS) but can still take a second of CPU for a large or hostile one, and
a directory may hold many. Parsed on a thread of the daemon, that CPU time would hold the
daemon's GIL (measured: `status` answers stalled past 100 ms beside a busy worker); parsed
in a child process it costs the daemon neither time nor memory, and a read that runs away
can be killed. The child is `python -m tpud.jobfiles.offloop` (the daemon has threads: forking
it would be unsafe), imports only the torch-free job-file modules and dies with the daemon.
Calls and results cross a socket pair as pickles. Not a multiprocessing pool: a pool worker
waits for its next task holding the pool's queue lock, so one killed while idle took the lock
with it, and the pool's next worker (the reads: blind until the read timeout) and the pool's
finalizer at exit (the daemon: hung for good after "tpud stopped") waited for it forever.
Nor a multiprocessing process: it brings the resource tracker, one more helper to lose.

One reader thread owns the child. It sends the reads, first come first served, and hands each
result to the loop in the order the reads ran; a read asked for again before it started
runs once. Between reads it waits on the child's socket too, so a child that dies is seen at
once and started again (tpud/children/respawn.py); a read whose child died under it runs once more, on
the next child. close() ends the thread and the child within seconds, whatever their state.
"""

from __future__ import annotations

import argparse
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import structlog

from engine.spec.loader import LoadedSpec
from tpud.jobfiles.reading import JobFile, scan
from tpud.children import ranks
from tpud.children.respawn import Respawn
from tpud.settings import Settings, load_settings
from tpud.children.process import die_with_parent, exit_status

log = structlog.get_logger()
READ_TIMEOUT_S = 120.0  # a whole jobs.d; each file is bounded, so only thousands of files come near
START_TIMEOUT_S = 60.0  # a reader's start-up: a Python and the torch-free job-file modules, seconds
CLOSE_TIMEOUT_S = 5.0  # close() waits this long at most for the reader thread


# --- what runs in the helper process (module-level: the calls are pickled) ---


def refusal(loaded: LoadedSpec, settings: Settings, config_dir: Path) -> str | None:
    """Why a valid spec may not run under these settings, as FILE:LINE: KEY: MESSAGE."""
    spec = loaded.spec
    if spec.debug.inject is not None and not settings.allow_fault_injection:
        return str(loaded.problem("debug.inject", "fault injection is refused: set allow_fault_injection: true "
                                                  f"in {config_dir / 'tpud.yaml'} to allow it"))
    processes = ranks.processes_per_host(spec.device)
    if (too_many := ranks.too_many(spec.device, processes)) is not None:
        return str(loaded.problem("device.processes_per_host", too_many))
    return None


def read_jobs(jobs_dir: Path, settings: Settings, config_dir: Path,
              remote: tuple[Path, str] | None = None) -> dict[Path, JobFile]:
    """jobs.d as it is now, and the mirror of remote_jobs (remote: the mirror and its URL) after it,
    a valid job these settings refuse counted as invalid. A remote file's errors name its URL."""
    files = scan(jobs_dir, *([remote[0]] if remote else []))
    for path, job_file in files.items():
        if job_file.spec is not None and (refused := refusal(job_file.loaded, settings, config_dir)):
            files[path] = job_file = JobFile.invalid(path, job_file.digest, refused)
        if remote and job_file.error is not None and path.parent == remote[0]:
            files[path] = JobFile.invalid(path, job_file.digest,
                                          job_file.error.replace(f"{remote[0]}/", f"{remote[1].rstrip('/')}/"))
    return files


@dataclass(frozen=True)
class Reloaded:
    settings: Settings
    error: str | None
    files: dict[Path, JobFile]


def reload(jobs_dir: Path, config_dir: Path, remote: tuple[Path, str] | None = None) -> Reloaded:
    """SIGHUP: tpud.yaml again, then jobs.d (and remote_jobs' mirror) under the new settings."""
    settings, error = load_settings(config_dir)
    return Reloaded(settings, error, read_jobs(jobs_dir, settings, config_dir, remote))


# --- the wire: one pickle per message, behind its length ---

_LENGTH = struct.Struct("!Q")


def _message(obj: Any) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(data)) + data


def _receive(sock: socket.socket) -> bytes:
    """One message's pickle; EOFError when the other end is gone (a socket timeout raises TimeoutError)."""
    (size,) = _LENGTH.unpack(_exactly(sock, _LENGTH.size))
    return _exactly(sock, size)


def _exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(min(size - len(data), 1 << 20))
        if not chunk:
            raise EOFError("the other end closed the socket")
        data += chunk
    return bytes(data)


def main(argv: list[str] | None = None) -> int:
    """The child: take the daemon's sys.path and say it is ready, then run each call that arrives and
    answer (True, result) or (False, traceback); exit at EOF."""
    parser = argparse.ArgumentParser(prog="python -m tpud.jobfiles.offloop",
                                     description="tpud's job-file reader (internal; the daemon runs it).")
    parser.add_argument("fd", type=int, help="the socket the calls arrive on")
    parser.add_argument("--parent", type=int, required=True, help="exit if this process is not our parent")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the daemon's to handle
    die_with_parent(args.parent)
    sock = socket.socket(fileno=args.fd)
    try:
        sys.path[:] = pickle.loads(_receive(sock))  # the daemon's: the calls name its modules
        sock.sendall(_message(os.getpid()))  # ready: a read's timeout starts now, not at our start-up
    except (EOFError, ConnectionError):
        return 0
    while True:
        try:
            call = _receive(sock)
        except (EOFError, ConnectionError):
            return 0
        try:
            fn, call_args = pickle.loads(call)
            reply = _message((True, fn(*call_args)))
        except Exception as e:  # noqa: BLE001 - the daemon logs it; this reader serves the next call
            reply = _message((False, "".join(traceback.format_exception(e))))
        sock.sendall(reply)


# --- the daemon's side ---


class _Died(Exception):
    pass


class _Closed(Exception):
    pass


class _Reader:
    """One child process and the daemon's end of its socket."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        with theirs:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tpud.jobfiles.offloop", str(theirs.fileno()), "--parent", str(os.getpid())],
                stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),))
        self.sock, self.pid = ours, self.proc.pid
        ours.sendall(_message(sys.path))

    def interrupt(self) -> None:
        """From another thread: wake a send or receive in progress on the reader's thread."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # already closed
            pass

    def stop(self) -> int:
        """Kill the child (a no-op once it exited) and reap it: its exit status."""
        self.sock.close()
        self.proc.kill()
        return exit_status(self.proc.wait())


@dataclass(frozen=True)
class _Task:
    name: str
    fn: Callable[..., Any]
    args: Callable[[], tuple]    # evaluated on the reader thread, just before the call
    then: Callable[[Any], None]  # on the loop, with the result
    seen: Callable[[Any], None] | None = None  # on the reader thread, before later reads run
    retry: bool = True  # run it again if the child dies under it


class OffLoop:
    def __init__(self, post: Callable[[Callable[[], None]], None], timeout: float = READ_TIMEOUT_S):
        """`post(fn)` runs fn on the loop thread (the daemon's post)."""
        self._post, self.timeout = post, timeout
        self._respawn = Respawn()
        self._tasks: deque[_Task] = deque()
        self._queued: set[str] = set()
        self._lock = threading.Lock()  # the tasks, _closed and _reader, between the threads
        self._closed = False
        self._reader: _Reader | None = None  # set and stopped by the reader thread only
        self._wake_r, self._wake_w = socket.socketpair()  # a submit or close() wakes the reader thread
        self._wake_w.setblocking(False)
        self._thread = threading.Thread(target=self._run, name="tpud-reader", daemon=True)
        self._thread.start()

    @property
    def pid(self) -> int | None:
        """The reader process's id; None while none runs."""
        reader = self._reader
        return None if reader is None else reader.pid

    def submit(self, name: str, fn: Callable[..., Any], args: Callable[[], tuple], then: Callable[[Any], None],
               seen: Callable[[Any], None] | None = None) -> None:
        """Run `fn(*args())` in the helper process, then `then(result)` on the loop; a no-op
        while a read named `name` waits to start. `fn` must be a module-level function."""
        with self._lock:
            if self._closed or name in self._queued:
                return
            self._queued.add(name)
            self._tasks.append(_Task(name, fn, args, then, seen))
        self._wake()

    def close(self) -> None:
        """Start nothing more; end the reader thread and the child (a read in progress is dropped)."""
        with self._lock:
            if self._closed:
                return
            self._closed, reader = True, self._reader
        self._wake()
        if reader is not None:
            reader.interrupt()
        self._thread.join(CLOSE_TIMEOUT_S)
        if not self._thread.is_alive():
            self._wake_r.close()
            self._wake_w.close()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except BlockingIOError:
            pass  # already awake

    # --- the reader thread ---

    def _run(self) -> None:
        try:
            while not self._closed:
                if self._reader is None and not self._start():
                    self._wait([], max(0.0, self._respawn.due - time.monotonic()))
                    continue
                with self._lock:
                    task = self._tasks.popleft() if self._tasks else None
                    if task is not None:
                        self._queued.discard(task.name)
                if task is not None:
                    self._run_task(task)
                elif self._wait([self._reader.sock], None):  # it never speaks unasked: it died
                    self._lost(None)
        except _Closed:
            pass
        finally:
            self._stop()

    def _start(self) -> bool:
        """Start a child unless a backoff is due; False if none runs."""
        if not self._respawn.ready():
            return False
        self._respawn.started()
        try:
            reader = _Reader()
        except OSError as e:  # out of processes or descriptors, say: try again after a backoff
            log.error("cannot start the job-file reader", error=str(e), in_s=round(self._respawn.died(), 1))
            return False
        with self._lock:
            self._reader = reader
        try:
            self._await(reader.sock, time.monotonic() + START_TIMEOUT_S)
            _receive(reader.sock)
        except TimeoutError:
            self._stop()
            log.error("the job-file reader did not start in time; starting another", pid=reader.pid,
                      timeout_s=START_TIMEOUT_S, in_s=round(self._respawn.died(), 1))
            return False
        except (EOFError, OSError) as e:
            if self._closed:  # close() shut the socket down under us
                raise _Closed from e
            self._lost(None)
            return False
        log.info("job-file reader started", pid=reader.pid)
        return True

    def _stop(self) -> int | None:
        with self._lock:
            reader, self._reader = self._reader, None
        return None if reader is None else reader.stop()

    def _lost(self, read: str | None) -> None:
        pid, status = self._reader.pid, self._stop()
        in_s = self._respawn.died()
        log.error("the job-file reader exited; starting it again", pid=pid, status=status, read=read,
                  in_s=round(in_s, 1))

    def _wait(self, socks: list[socket.socket], timeout: float | None) -> list[socket.socket]:
        """Those of `socks` that became readable; [] when woken by a submit or the timeout.
        Raises _Closed once close() was called."""
        ready = wait([self._wake_r, *socks], timeout)
        if self._wake_r in ready:
            try:
                while self._wake_r.recv(4096, socket.MSG_DONTWAIT):
                    pass
            except BlockingIOError:
                pass
        if self._closed:
            raise _Closed
        return [s for s in ready if s is not self._wake_r]

    def _await(self, sock: socket.socket, deadline: float) -> None:
        """Until `sock` is readable (a message, or the child's death); TimeoutError at the deadline."""
        while not self._wait([sock], max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise TimeoutError

    def _run_task(self, task: _Task) -> None:
        try:
            ok, value = self._call(task.fn, task.args())
        except _Died:
            self._lost(task.name)
            with self._lock:
                if task.retry and task.name not in self._queued:  # (else a later ask is queued already)
                    self._queued.add(task.name)
                    self._tasks.appendleft(replace(task, retry=False))
            return
        except _Closed:
            raise
        except TimeoutError:
            log.error("reading job files took too long; restarting the reader", read=task.name,
                      timeout_s=self.timeout)
            self._stop()
            return
        except Exception:  # noqa: BLE001 - a strange file must never stop later reads
            log.exception("background read failed", read=task.name)
            return
        if not ok:
            log.error("background read failed", read=task.name, error=value)
            return
        if task.seen is not None:
            task.seen(value)
        self._post(lambda: task.then(value))

    def _call(self, fn: Callable[..., Any], args: tuple) -> tuple[bool, Any]:
        """(ok, result or traceback) from the child; _Died, TimeoutError or _Closed otherwise."""
        sock, deadline = self._reader.sock, time.monotonic() + self.timeout
        try:
            sock.settimeout(self.timeout)
            sock.sendall(_message((fn, args)))
            self._await(sock, deadline)
            sock.settimeout(max(0.001, deadline - time.monotonic()))  # a reply that stops halfway
            reply = _receive(sock)
        except (EOFError, OSError) as e:
            if self._closed:  # close() shut the socket down under us
                raise _Closed from e
            if isinstance(e, (EOFError, ConnectionError)):
                raise _Died from e
            raise
        return pickle.loads(reply)


if __name__ == "__main__":
    sys.exit(main())
