"""The fork server: imports torch, torch._dynamo and the engine once, then forks every worker.

A worker's first seconds go to imports (torch, the engine, and torch._dynamo, which torch.optim's
first constructor pulls in): 5-6 CPU-seconds at every start and restart. The daemon runs one fork
server, started with the first worker it needs; once the server is warm a worker is a fork of it and
reaches its first step in a fraction of a second, first starts and restarts alike.

`python -m tpud.worker.forkserver FD --parent PID`: FD is a SOCK_SEQPACKET socket to the daemon,
one JSON message a packet:

    server -> daemon  {"ready": true}                        warm: the imports are done
    daemon -> server  {"argv": [...], "env": {...}, "cwd": ".."} and the worker's stdout (SCM_RIGHTS)
    server -> daemon  {"pid": N} or {"error": ".."}           the answer to that request
    server -> daemon  {"exited": N, "code": C}               a worker ended (C: Popen's returncode)

The server stays single-threaded, so a fork never copies a thread that holds a lock (the idle
OpenBLAS pool that numpy starts handles fork itself), and it touches no device. A forked worker is
what `python -m tpud.worker ARGV` would be: its own session, stdin from /dev/null, stdout and stderr
on the daemon's pipe, the environment it is given. It dies with the server (parent-death signal),
which dies with the daemon. Only the server can reap its workers, so it relays their exit codes.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import setproctitle
import structlog

from tpud.children.respawn import Respawn
from tpud.children.process import die_with_parent

log = structlog.get_logger()

MAX_MESSAGE = 1 << 20  # a request carries the environment: far below this
REPLY_TIMEOUT_S = 30.0  # a fork takes milliseconds; a server this slow to answer is broken
WARM_UP_TIMEOUT_S = 600.0  # imports that take longer (a hung file system): start workers cold
STOP_SIGNALS = {signal.SIGTERM, signal.SIGUSR1}


class ForkServer:
    """The daemon's side: starts the server when a worker is first wanted, forks workers through it,
    and falls back to cold starts (`python -m tpud.worker`) while it cannot serve. Loop thread only."""

    def __init__(self, loop, clock: Callable[[], float] = time.monotonic):
        """`loop` watches the server's socket and runs posted calls (the daemon's watch and post)."""
        self.loop, self.clock = loop, clock
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.warm = False
        self._started_at = 0.0
        self._waiting: list[Callable[[], None]] = []
        self._codes: dict[int, int] = {}  # exit codes relayed for workers not yet waited for
        self._respawn = Respawn(clock)

    def ready(self) -> bool:
        """Whether a worker may start now: forked when the server is warm, cold while it is down and
        waiting out its backoff. Starts the server if none runs; False while it imports."""
        if self.proc is None:
            if not self._respawn.ready():
                return True
            self._start()
        return self.warm

    def when_ready(self, fn: Callable[[], None]) -> None:
        """Call fn on the loop once ready() turns true (or the server is lost)."""
        self._waiting.append(fn)

    def tick(self) -> None:
        """A server whose imports ran past WARM_UP_TIMEOUT_S is given up (the loop calls this every turn)."""
        if self.proc is not None and not self.warm and self.clock() - self._started_at > WARM_UP_TIMEOUT_S:
            self._lost(f"its imports took more than {WARM_UP_TIMEOUT_S:.0f} s")

    def fork(self, argv: list[str], env: dict[str, str]) -> ForkedWorker | None:
        """A worker forked with these arguments and this environment, or None when the server cannot
        fork one now (the caller starts it cold)."""
        if not self.warm:
            return None
        read_end, write_end = os.pipe()
        request = {"argv": argv, "env": {**env, "TPUD_SUPERVISOR_PID": str(self.proc.pid)}, "cwd": os.getcwd()}
        try:
            socket.send_fds(self.sock, [json.dumps(request).encode()], [write_end])
            reply = self._receive_until(lambda m: "pid" in m or "error" in m, REPLY_TIMEOUT_S)
        except (OSError, ValueError, TimeoutError) as e:
            os.close(read_end)
            self._lost(f"it did not answer a fork: {e}")
            return None
        finally:
            os.close(write_end)  # the worker has its own copy: the pipe ends when the worker does
        if "error" in reply:
            os.close(read_end)
            log.warning("the fork server could not fork a worker; starting it cold", error=reply["error"])
            return None
        return ForkedWorker(self, reply["pid"], open(read_end, "rb"))

    def returncode(self, pid: int, block: bool) -> int | None:
        """A forked worker's exit code once the server has relayed it (Popen's convention: -N for
        signal N). A worker whose server was lost died with it: killed."""
        if pid not in self._codes and self.sock is not None:
            if not block:
                self._drain()
            else:
                try:
                    self._receive_until(lambda m: m.get("exited") == pid, REPLY_TIMEOUT_S)
                except (OSError, ValueError, TimeoutError) as e:
                    self._lost(f"it did not report a worker's exit: {e}")
        if pid in self._codes:
            return self._codes.pop(pid)
        return -9 if self.sock is None else None

    def close(self) -> None:
        """The daemon is exiting (its workers have ended): the server exits as its socket closes."""
        proc, warm = self.proc, self.warm
        self._disconnect()
        if proc is not None:
            if not warm:
                proc.kill()  # still importing: nothing to finish
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    # --- the server process, from the daemon's side ---

    def _start(self) -> None:
        from tpud.children.process import worker_env

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._respawn.started()
        self._started_at, self.warm = self.clock(), False
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tpud.worker.forkserver", str(theirs.fileno()), "--parent", str(os.getpid())],
            stdin=subprocess.DEVNULL, pass_fds=[theirs.fileno()], env=worker_env("json"),
            start_new_session=True)  # a terminal's Ctrl-C reaches only the daemon, which stops the workers
        theirs.close()
        self.sock = ours
        self.sock.setblocking(False)
        self.loop.watch(self.sock, self._drain)
        log.info("fork server started", pid=self.proc.pid)

    def _drain(self) -> None:
        """The socket is readable: take every message waiting on it."""
        while self.sock is not None:
            try:
                data = self.sock.recv(MAX_MESSAGE)
            except BlockingIOError:
                return
            except OSError as e:
                self._lost(str(e))
                return
            if not data:
                self._lost("it exited")
                return
            self._take(json.loads(data))

    def _receive_until(self, wanted: Callable[[dict], bool], timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.sock], [], [], left)[0]:
                raise TimeoutError(f"no answer in {timeout:.0f} s")
            data = self.sock.recv(MAX_MESSAGE)
            if not data:
                raise OSError("the fork server exited")
            message = json.loads(data)
            self._take(message)
            if wanted(message):
                return message

    def _take(self, message: dict) -> None:
        if "exited" in message:
            self._codes[message["exited"]] = message["code"]
        elif message.get("ready"):
            self.warm = True
            log.info("fork server ready", pid=self.proc.pid, seconds=round(self.clock() - self._started_at, 2))
            self._wake_waiting()

    def _lost(self, why: str) -> None:
        proc = self.proc
        self._disconnect()
        if proc is not None:
            proc.kill()
            status = proc.wait()
            in_s = self._respawn.died()
            log.warning("the fork server is gone; workers start cold until it is back", why=why,
                        status=128 - status if status < 0 else status, in_s=round(in_s, 1))
        self._wake_waiting()

    def _disconnect(self) -> None:
        if self.sock is not None:
            self.loop.unwatch(self.sock)
            self.sock.close()
        self.sock, self.proc, self.warm = None, None, False

    def _wake_waiting(self) -> None:
        waiting, self._waiting = self._waiting, []
        for fn in waiting:
            self.loop.post(fn)


class ForkedWorker:
    """A forked worker as a subprocess.Popen would show it: pid, stdout, poll(), wait()."""

    stdin = None

    def __init__(self, server: ForkServer, pid: int, stdout):
        self.server, self.pid, self.stdout = server, pid, stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.returncode(self.pid, block=False)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = self.server.returncode(self.pid, block=True)
        return self.returncode


# --- the server process (python -m tpud.worker.forkserver) ---

def _warm_up() -> None:
    setproctitle.getproctitle()  # finds the memory it may write titles into, while the environment is the original
    import torch._dynamo  # noqa: F401

    import engine.train  # noqa: F401
    import tpud.worker.entry  # noqa: F401


def serve(sock: socket.socket) -> int:
    """Answer fork requests and relay the workers' exits until the daemon closes the socket."""
    children: dict[int, int] = {}  # a worker's pidfd -> its pid
    while True:
        readable, _, _ = select.select([sock, *children], [], [])
        for ready in readable:
            if ready is sock:
                message, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 4)
                if not message:
                    return 0
                sock.send(json.dumps(_fork(json.loads(message), fds, sock, children)).encode())
            else:
                pid = children.pop(ready)
                os.close(ready)
                _, status = os.waitpid(pid, 0)
                sock.send(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def _fork(request: dict, fds: list[int], sock: socket.socket, children: dict[int, int]) -> dict:
    for extra in fds[1:]:
        os.close(extra)
    if not fds:
        return {"error": "a request without the worker's stdout"}
    stdout, server = fds[0], os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    # Held until the child's own handlers record them: a stop asked the instant it is forked is
    # not fatal (the server's SIGTERM is the default action); the worker checkpoints and exits 75.
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        pid = os.fork()
    except OSError as e:
        os.close(stdout)
        return {"error": f"fork: {e}"}
    finally:
        if os.getpid() == server:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    if pid == 0:
        try:
            sock.close()
            for pidfd in children:
                os.close(pidfd)
            _become_worker(request, stdout, server)
        finally:
            os._exit(70)  # only if becoming the worker itself failed: it never returns
    os.close(stdout)
    children[os.pidfd_open(pid)] = pid
    return {"pid": pid}


def _become_worker(request: dict, stdout: int, server: int) -> None:
    """In the child: set up the process as `python -m tpud.worker ARGV` would find it, then run it."""
    from tpud.worker import record_early_signals
    from tpud.worker.entry import main, run_and_exit

    early_signals = record_early_signals()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    os.setsid()
    die_with_parent(server)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(stdout, 1)
    os.dup2(stdout, 2)
    os.close(null)
    os.close(stdout)
    os.chdir(request["cwd"])
    setproctitle.setproctitle(" ".join([sys.executable, "-m", "tpud.worker", *request["argv"]]))
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [sys.argv[0], *request["argv"]]
    run_and_exit(lambda: main(request["argv"], early_signals))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tpud.worker.forkserver",
                                     description="tpud's fork server (internal; the daemon runs it).")
    parser.add_argument("fd", type=int, help="the daemon's SOCK_SEQPACKET socket")
    parser.add_argument("--parent", type=int, default=None, help="exit if this process is not our parent")
    args = parser.parse_args(argv)
    die_with_parent(args.parent)
    sock = socket.socket(fileno=args.fd)
    _warm_up()
    try:
        sock.send(json.dumps({"ready": True}).encode())
        return serve(sock)
    except (BrokenPipeError, ConnectionResetError):
        return 0  # the daemon is gone


if __name__ == "__main__":
    sys.exit(main())
