"""The daemon's control socket: <runtime>/control.sock (mode 0660), newline-delimited JSON.

One request line, one reply line, in order; a connection may carry any number of requests.

request  {"version": 1, "command": "status", "jobs": [names]}              (empty: all jobs)
         {"version": 1, "command": "checkpoint_now", "jobs": [names], "wait": bool, "timeout": seconds}
         {"version": 1, "command": "stop" | "start", "job": name}
reply    {"version": 1, "ok": true, "result": {...}, "handled_seconds": s}
         {"version": 1, "ok": false, "error": "message", "code": CODE, "handled_seconds": s}

handled_seconds is the daemon's own time from the complete request line to its reply (a
status waiting on a busy daemon shows there, not only in the client's wall time).

CODE is bad_request (malformed line, wrong version, unknown command or argument, wrong type),
unknown_job, not_running, timeout, or internal (the handler failed; logged). Arguments left out
take their defaults (jobs [], wait true, timeout DEFAULT_CHECKPOINT_TIMEOUT_S); unknown
arguments are rejected. Non-finite floats in results are sent as null (strict JSON).

A bad line gets an error reply and the connection stays usable; a line over MAX_LINE bytes
gets an error reply and the connection is closed; a client that sends no complete line for
`idle_timeout` seconds is dropped. Each connection has its own thread, so a slow request
never holds up another client. At `max_connections`, a new connection closes the one that has
waited longest for a request line (a silent or dribbling client), so that idle connections can
never lock an operator out; only when every connection is inside a request is a new one
refused. Torch-free, and the client side imports no structlog: `tpud status` starts in
tens of milliseconds.
"""

from __future__ import annotations

import errno
import itertools
import json
import math
import os
import socket
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

VERSION = 1
MAX_LINE = 1 << 20          # bytes in one request line, newline excluded
MAX_REPLY = 64 << 20        # what the client accepts
IDLE_TIMEOUT_S = 60.0
MAX_CONNECTIONS = 256
DEFAULT_CHECKPOINT_TIMEOUT_S = 600.0

CODES = ("bad_request", "unknown_job", "not_running", "timeout", "internal")
COMMANDS = ("status", "checkpoint_now", "stop", "start")


class ControlError(Exception):
    """An error reply: raised by handlers (the server sends it) and by the client (it got one)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message

    def __str__(self) -> str:
        return self.message


class DaemonUnreachable(Exception):
    """The client could not get a reply from the socket at `path`; `reason` says why."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"cannot reach the tpud daemon at {path}: {reason}")
        self.path, self.reason = Path(path), reason


# --- requests -----------------------------------------------------------------------------------

def _names(value: Any, key: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ControlError("bad_request", f"{key} must be a list of job names (non-empty strings)")
    return list(dict.fromkeys(value))  # drop duplicates, keep order


def _name(value: Any, key: str) -> str:
    if not isinstance(value, str) or not value:
        raise ControlError("bad_request", f"{key} must be a job name (a non-empty string)")
    return value


def _bool(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ControlError("bad_request", f"{key} must be true or false")
    return value


def _seconds(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ControlError("bad_request", f"{key} must be a positive number of seconds")
    return float(value)


# command -> {argument: (parser, default)}; a default of ... means required
_ARGS: dict[str, dict[str, tuple[Callable[[Any, str], Any], Any]]] = {
    "status": {"jobs": (_names, []), "gang": (_bool, False)},
    "checkpoint_now": {"jobs": (_names, []), "wait": (_bool, True),
                       "timeout": (_seconds, DEFAULT_CHECKPOINT_TIMEOUT_S)},
    "stop": {"job": (_name, ...)},
    "start": {"job": (_name, ...)},
}


def parse_request(line: bytes) -> dict:
    """A request line -> the validated request with defaults filled in; ControlError("bad_request")."""
    try:
        request = json.loads(line)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise ControlError("bad_request", f"not a JSON line: {e}") from None
    if not isinstance(request, dict):
        raise ControlError("bad_request", "a request must be a JSON object")
    if "version" not in request:
        raise ControlError("bad_request", f'missing "version" (this daemon speaks version {VERSION})')
    version = request["version"]
    if isinstance(version, bool) or version != VERSION:
        raise ControlError("bad_request", f"unsupported version {json.dumps(version)[:40]} "
                                          f"(this daemon speaks version {VERSION})")
    command = request.get("command")
    if not isinstance(command, str) or command not in _ARGS:
        shown = json.dumps(command)[:60] if command is not None else "none"
        raise ControlError("bad_request", f"unknown command {shown} (one of {', '.join(COMMANDS)})")
    spec = _ARGS[command]
    unknown = sorted(set(request) - set(spec) - {"version", "command"})
    if unknown:
        raise ControlError("bad_request", f"unknown argument(s) for {command}: {', '.join(unknown)[:200]}")
    parsed: dict[str, Any] = {"version": VERSION, "command": command}
    for key, (parse, default) in spec.items():
        if key in request:
            parsed[key] = parse(request[key], key)
        elif default is ...:
            raise ControlError("bad_request", f"{command} needs {key}")
        else:
            parsed[key] = list(default) if isinstance(default, list) else default
    return parsed


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _encode(message: dict) -> bytes:
    try:
        text = json.dumps(message, allow_nan=False)
    except ValueError:
        text = json.dumps(_finite(message), allow_nan=False)
    return text.encode() + b"\n"


def _failure(code: str, message: str) -> dict:
    return {"version": VERSION, "ok": False, "error": message, "code": code}


def _error(code: str, message: str) -> bytes:
    return _encode(_failure(code, message))


# --- server -------------------------------------------------------------------------------------

class ControlServer:
    """Serve `handle(request) -> result` on a Unix socket; see the module docstring."""

    # At most one warning a minute about connections closed at the limit: a flood must not flood the log.
    EVICTION_LOG_INTERVAL_S = 60.0

    def __init__(self, path: Path, handle: Callable[[dict], dict], *, idle_timeout: float = IDLE_TIMEOUT_S,
                 max_line: int = MAX_LINE, max_connections: int = MAX_CONNECTIONS):
        import structlog  # here, not at the top: the CLI imports this module for the client alone

        self._log = structlog.get_logger()
        self.path, self.handle = Path(path), handle
        self.idle_timeout, self.max_line, self.max_connections = idle_timeout, max_line, max_connections
        self._sock: socket.socket | None = None
        self._inode: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()
        self._lock = threading.Lock()
        # Each open connection -> the ticket it drew when it began waiting for its current request
        # line (the smallest has waited longest), or None while its request is being handled.
        self._connections: dict[socket.socket, int | None] = {}
        self._tickets = itertools.count()
        self._evicted, self._evicted_logged = 0, -self.EVICTION_LOG_INTERVAL_S

    def __enter__(self) -> ControlServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def connections(self) -> int:
        """Client connections open now."""
        with self._lock:
            return len(self._connections)

    def start(self) -> None:
        parent = self.path.parent
        if not parent.is_dir():
            parent.mkdir(parents=True, mode=0o750, exist_ok=True)
            os.chmod(parent, 0o750)
        self._remove_stale()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(self.path))
            os.chmod(self.path, 0o660)  # the directory (0750) keeps others out in the meantime
            sock.listen(64)
            sock.settimeout(0.5)  # accept() also polls _closed, should shutdown() not wake it
            st = os.stat(self.path)
        except BaseException:
            sock.close()
            raise
        self._sock, self._inode = sock, (st.st_dev, st.st_ino)
        self._thread = threading.Thread(target=self._accept_loop, name="tpud-control", daemon=True)
        self._thread.start()
        self._log.info("control socket listening", path=str(self.path))

    def _remove_stale(self) -> None:
        try:
            mode = os.lstat(self.path).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            raise FileExistsError(errno.EEXIST, "exists and is not a socket; not removing it", str(self.path))
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(str(self.path))
        except (ConnectionRefusedError, FileNotFoundError):
            pass  # stale: nobody listens
        else:
            raise OSError(errno.EADDRINUSE, "another daemon is listening on this control socket", str(self.path))
        finally:
            probe.close()
        self.path.unlink(missing_ok=True)
        self._log.info("removed stale control socket", path=str(self.path))

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes accept() on Linux
            except OSError:
                pass
            self._sock.close()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # wakes their recv(); the threads close them
            except OSError:
                pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        try:  # remove the socket file only if it is still ours
            st = os.stat(self.path)
            if self._inode == (st.st_dev, st.st_ino):
                self.path.unlink()
        except OSError:
            pass

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError as e:
                if self._closed.is_set():
                    return
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._log.error("control socket: cannot accept", error=str(e))
                    time.sleep(0.1)
                    continue
                if e.errno in (errno.ECONNABORTED, errno.EINTR):
                    continue
                self._log.error("control socket: accept failed, no longer serving", error=str(e))
                return
            with self._lock:
                if len(self._connections) >= self.max_connections:
                    self._evict_longest_idle()
                full = len(self._connections) >= self.max_connections
                if not full:
                    self._connections[conn] = next(self._tickets)
            if full:
                self._refuse(conn)
                continue
            threading.Thread(target=self._serve, args=(conn,), name="tpud-control-conn", daemon=True).start()

    def _evict_longest_idle(self) -> None:
        """Close the connection that has waited longest for a request line, if one waits (lock held).
        Its thread wakes from recv() and ends; a request it completes meanwhile is dropped unanswered."""
        waiting = [(ticket, conn) for conn, ticket in self._connections.items() if ticket is not None]
        if not waiting:
            return
        _, conn = min(waiting, key=lambda item: item[0])
        del self._connections[conn]
        try:
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._evicted += 1
        now = time.monotonic()
        if now - self._evicted_logged >= self.EVICTION_LOG_INTERVAL_S:
            self._log.warning("control connections at the limit: closed the longest idle ones",
                              limit=self.max_connections, closed=self._evicted)
            self._evicted, self._evicted_logged = 0, now

    def _mark(self, conn: socket.socket, waiting: bool) -> bool:
        """Record that `conn` now waits for a request line (a new ticket) or is handling one (None);
        False when it was evicted meanwhile."""
        with self._lock:
            if conn not in self._connections:
                return False
            self._connections[conn] = next(self._tickets) if waiting else None
            return True

    def _refuse(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(1.0)
            conn.sendall(_error("internal", f"too many control connections ({self.max_connections}), each inside "
                                            "a request; try again"))
        except OSError:
            pass
        conn.close()

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._serve_lines(conn)
        except Exception:  # never let one connection take anything else down
            self._log.exception("control connection failed")
        finally:
            with self._lock:
                self._connections.pop(conn, None)
            conn.close()

    def _serve_lines(self, conn: socket.socket) -> None:
        buffer = bytearray()
        scanned = 0  # bytes of buffer known to hold no newline
        deadline = time.monotonic() + self.idle_timeout
        while not self._closed.is_set():
            newline = buffer.find(b"\n", scanned)
            if newline < 0:
                scanned = len(buffer)
                if len(buffer) > self.max_line:
                    self._send(conn, _error("bad_request", f"request line longer than {self.max_line} bytes; "
                                                           "closing the connection"))
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return  # idle client
                conn.settimeout(remaining)
                try:
                    chunk = conn.recv(65536)
                except OSError:  # timeout, reset, shutdown by close() or an eviction
                    return
                if not chunk:
                    return  # EOF; an unfinished line is dropped
                buffer += chunk
                continue
            received = time.monotonic()
            line = bytes(buffer[:newline])
            del buffer[:newline + 1]
            scanned = 0
            if len(line) > self.max_line:
                self._send(conn, _error("bad_request", f"request line longer than {self.max_line} bytes; "
                                                       "closing the connection"))
                return
            if not self._mark(conn, waiting=False):
                return
            reply = self._respond(line)
            reply["handled_seconds"] = round(time.monotonic() - received, 6)
            if not self._send(conn, _encode(reply)) or not self._mark(conn, waiting=True):
                return
            deadline = time.monotonic() + self.idle_timeout

    def _send(self, conn: socket.socket, data: bytes) -> bool:
        try:
            conn.settimeout(self.idle_timeout)  # a client that never reads is dropped too
            conn.sendall(data)
            return True
        except OSError:
            return False

    def _respond(self, line: bytes) -> dict:
        try:
            request = parse_request(line)
        except ControlError as e:
            return _failure(e.code, e.message)
        try:
            result = self.handle(request)
            if not isinstance(result, dict):
                raise TypeError(f"handler returned {type(result).__name__}, not a dict")
            return {"version": VERSION, "ok": True, "result": result}
        except ControlError as e:
            return _failure(e.code if isinstance(e.code, str) else "internal", str(e.message))
        except Exception as e:
            self._log.exception("control request failed", command=request["command"])
            return _failure("internal", f"{request['command']} failed inside the daemon: {type(e).__name__}: {e}")


# --- client -------------------------------------------------------------------------------------

class ControlClient:
    """Send one request per call on a fresh connection. A `timeout` argument (checkpoint_now)
    extends the wait for the reply by that many seconds."""

    def __init__(self, path: Path, timeout: float = 10.0):
        self.path, self.timeout = Path(path), timeout

    def call(self, command: str, **args: Any) -> dict:
        """The request's result; ControlError for an error reply, DaemonUnreachable for no reply."""
        return self.reply(command, **args)["result"]

    def reply(self, command: str, **args: Any) -> dict:
        """The whole successful reply: the result and the daemon's handled_seconds."""
        wait = self.timeout
        extra = args.get("timeout")
        if isinstance(extra, (int, float)) and not isinstance(extra, bool) and math.isfinite(extra) and extra > 0:
            wait += extra
        deadline = time.monotonic() + wait
        request = json.dumps({"version": VERSION, "command": command, **args}).encode() + b"\n"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            try:
                sock.connect(str(self.path))
            except FileNotFoundError:
                raise DaemonUnreachable(self.path, "no such socket") from None
            except ConnectionRefusedError:
                raise DaemonUnreachable(self.path, "connection refused (a stale socket, nobody listens)") from None
            except PermissionError:
                raise DaemonUnreachable(self.path, "permission denied (the socket is mode 0660: join the "
                                                   "daemon's group or run as its user)") from None
            except socket.timeout:
                raise DaemonUnreachable(self.path, f"timed out connecting after {self.timeout:g}s") from None
            except OSError as e:
                raise DaemonUnreachable(self.path, e.strerror or str(e)) from None
            reply = self._exchange(sock, request, deadline, wait)
        finally:
            sock.close()
        try:
            message = json.loads(reply)
        except ValueError as e:
            raise ControlError("internal", f"malformed reply from {self.path}: {e}") from None
        if not isinstance(message, dict) or message.get("version") != VERSION:
            raise ControlError("internal", f"unexpected reply from {self.path} (protocol version "
                                           f"{message.get('version') if isinstance(message, dict) else '?'}, "
                                           f"this client speaks {VERSION})")
        if message.get("ok") is True and isinstance(message.get("result"), dict):
            return message
        if message.get("ok") is False:
            raise ControlError(str(message.get("code", "internal")), str(message.get("error", "unknown error")))
        raise ControlError("internal", f"malformed reply from {self.path}")

    def _exchange(self, sock: socket.socket, request: bytes, deadline: float, wait: float) -> bytes:
        buffer = bytearray()
        try:
            try:
                sock.sendall(request)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the daemon may have replied (e.g. a rejected request) before closing: read on
            while True:
                newline = buffer.find(b"\n")
                if newline >= 0:
                    return bytes(buffer[:newline])
                if len(buffer) > MAX_REPLY:
                    raise ControlError("internal", f"reply from {self.path} longer than {MAX_REPLY} bytes")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise socket.timeout
                sock.settimeout(remaining)
                chunk = sock.recv(1 << 16)
                if not chunk:
                    raise DaemonUnreachable(self.path, "the daemon closed the connection before replying")
                buffer += chunk
        except socket.timeout:
            raise DaemonUnreachable(self.path, f"no reply within {wait:g}s") from None
        except OSError as e:
            # the server may have replied (e.g. a rejected request) before the connection broke
            newline = buffer.find(b"\n")
            if newline >= 0:
                return bytes(buffer[:newline])
            raise DaemonUnreachable(self.path, f"connection broken: {e.strerror or e}") from None
