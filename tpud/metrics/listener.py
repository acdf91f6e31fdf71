"""The /metrics HTTP listener, at a cost to the daemon that no number of scrapers can raise.

One thread serves every connection through a selector: it reads a request head (at most
MAX_HEAD bytes, within `timeout` seconds of the connection), answers GET or HEAD of any path
with the exposition, anything else with 405 (or 400 for what is not HTTP), and closes
(HTTP/1.0). A storm of scrapers therefore takes from the daemon at most:
- one thread: the loop and the control socket meet one more contender for the interpreter
  lock, not one per scrape (prometheus-client's thread-per-scrape server took 80-90% of a core
  under 20-40 scrapers, from the training worker on a 2-core host);
- `rate` answers a second: a request past it waits its turn, in order, its connection open
  (a scrape waits at most max_connections / rate = 3.2 s, inside Prometheus' 10 s timeout);
- a copy of the exposition per answer (Metrics rebuilds it only after a change);
- `max_connections` open connections: a new one closes the one that has been sending its
  request head longest, and when every one has sent it, no more are accepted until one is
  answered (they wait in the listen backlog).
Only the classic text format is served (no OpenMetrics, gzip or name[] filters). Torch-free.
"""

from __future__ import annotations

import collections
import selectors
import socket
import threading
import time
from collections.abc import Callable

import structlog

log = structlog.get_logger()

RATE = 20.0            # answers a second: far above Prometheus' needs (a scrape every few seconds), a few % of a core
MAX_CONNECTIONS = 64
MAX_HEAD = 8192        # bytes of request line and headers
TIMEOUT_S = 10.0       # to send a request head, and to take its answer
CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"  # the text format Metrics.exposition() writes


class _Connection:
    """reading its request head until `deadline`, then due (waiting its turn: no deadline, the
    wait is ours), then answering: `out` still to send until `deadline`."""

    __slots__ = ("sock", "state", "head", "deadline", "out")

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock, self.state, self.head, self.deadline = sock, "reading", bytearray(), deadline
        self.out = memoryview(b"")


def _answer(status: bytes, body: bytes = b"", *, content_type: bytes = b"text/plain; charset=utf-8",
            extra: bytes = b"", head_only: bool = False) -> bytes:
    return (b"HTTP/1.0 " + status + b"\r\nContent-Type: " + content_type + b"\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n" + extra + b"Connection: close\r\n\r\n" + (b"" if head_only else body))


class Exporter:
    """Serve `exposition()` over HTTP on (host, port); see the module docstring."""

    def __init__(self, exposition: Callable[[], bytes], *, rate: float = RATE,
                 max_connections: int = MAX_CONNECTIONS, timeout: float = TIMEOUT_S):
        self.exposition, self.rate, self.max_connections, self.timeout = exposition, rate, max_connections, timeout
        self._selector = selectors.DefaultSelector()
        self._listener: socket.socket | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread: threading.Thread | None = None
        self._closing = False
        # Open connections in the order they were accepted (the first still reading has read longest).
        self._open: dict[socket.socket, _Connection] = {}
        self._due: collections.deque[_Connection] = collections.deque()  # heads read, to answer in order
        self._next_answer = 0.0
        self._accepting = False
        self._resume_accepting = 0.0  # after running out of file descriptors: when to try again

    @property
    def address(self) -> tuple[str, int]:
        assert self._listener is not None
        bound = self._listener.getsockname()
        return str(bound[0]), int(bound[1])

    def start(self, host: str, port: int) -> tuple[str, int]:
        """Listen on (host, port) (port 0: a free one) and serve in a thread; the bound address."""
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE)[0]
        listener = socket.socket(family, kind, proto)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # rebind at once after a restart
            listener.bind(sockaddr)
            listener.listen(64)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            self.close()
            raise
        self._listener = listener
        self._selector.register(self._wake_r, selectors.EVENT_READ, self._drain_wake)
        self._accept_more(True)
        self._thread = threading.Thread(target=self._run, name="tpud-metrics", daemon=True)
        self._thread.start()
        return self.address

    def close(self) -> None:
        """Stop serving and release the port before returning. Idempotent."""
        if self._closing:
            return
        self._closing = True
        if self._thread is None:  # never started
            self._release()
            return
        self._wake_w.send(b"\0")
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    # --- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._closing:
                for key, events in self._selector.select(self._wait()):
                    try:
                        key.data(key.fileobj, events)
                    except Exception:  # one connection's trouble never stops the listener
                        log.exception("metrics connection failed")
                        if key.fileobj in self._open:
                            self._drop(self._open[key.fileobj])
                now = time.monotonic()
                for conn in [c for c in self._open.values() if c.state != "due" and c.deadline <= now]:
                    self._drop(conn)
                if self._resume_accepting and now >= self._resume_accepting:
                    self._resume_accepting = 0.0
                    self._accept_more(True)
                if self._due and now >= self._next_answer:
                    self._next_answer = now + 1.0 / self.rate
                    self._start_answer(self._due.popleft())
        finally:
            self._release()

    def _release(self) -> None:
        self._closing = True
        for conn in list(self._open.values()):
            self._drop(conn)
        self._selector.close()
        if self._listener is not None:
            self._listener.close()
        self._wake_r.close()
        self._wake_w.close()

    def _wait(self) -> float | None:
        """Seconds until the next deadline or the next answer, whichever is first; None: none."""
        times = [c.deadline for c in self._open.values() if c.state != "due"]
        if self._due:
            times.append(self._next_answer)
        if self._resume_accepting:
            times.append(self._resume_accepting)
        return max(0.0, min(times) - time.monotonic()) if times else None

    def _drain_wake(self, sock: socket.socket, events: int) -> None:
        sock.recv(4096)

    def _accept_more(self, accepting: bool) -> None:
        """Watch the listener, or leave new connections in its backlog."""
        if accepting != self._accepting and self._listener is not None:
            if accepting:
                self._selector.register(self._listener, selectors.EVENT_READ, self._accept)
            else:
                self._selector.unregister(self._listener)
            self._accepting = accepting

    def _accept(self, listener: socket.socket, events: int) -> None:
        while True:
            if len(self._open) >= self.max_connections and not self._evict_slowest_reader():
                self._accept_more(False)
                return
            try:
                sock, _ = listener.accept()
            except BlockingIOError:
                return
            except ConnectionAbortedError:  # reset by the client before it was accepted
                continue
            except OSError as e:
                # Out of descriptors or memory: the backlog keeps the connection; try again in a
                # second (or once one of ours closes) rather than spin on a listener still readable.
                log.error("metrics listener: cannot accept", error=str(e))
                self._accept_more(False)
                self._resume_accepting = time.monotonic() + 1.0
                return
            sock.setblocking(False)
            conn = self._open[sock] = _Connection(sock, time.monotonic() + self.timeout)
            self._selector.register(sock, selectors.EVENT_READ, self._read)

    def _evict_slowest_reader(self) -> bool:
        for conn in self._open.values():  # accepted first, first
            if conn.state == "reading":
                self._drop(conn)
                return True
        return False

    def _read(self, sock: socket.socket, events: int) -> None:
        conn = self._open.get(sock)
        if conn is None:  # dropped earlier in this round
            return
        try:
            chunk = sock.recv(MAX_HEAD + 1 - len(conn.head))
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(conn)
            return
        conn.head += chunk
        if b"\r\n\r\n" in conn.head or b"\n\n" in conn.head or len(conn.head) > MAX_HEAD:
            self._selector.unregister(sock)
            conn.state = "due"
            self._due.append(conn)

    def _start_answer(self, conn: _Connection) -> None:
        conn.state, conn.out = "answering", memoryview(self._respond(bytes(conn.head)))
        conn.deadline = time.monotonic() + self.timeout
        self._selector.register(conn.sock, selectors.EVENT_WRITE, self._write)
        self._write(conn.sock, selectors.EVENT_WRITE)

    def _respond(self, head: bytes) -> bytes:
        if len(head) > MAX_HEAD:
            return _answer(b"431 Request Header Fields Too Large", b"request head too large\n")
        parts = head.split(b"\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            return _answer(b"400 Bad Request", b"not an HTTP request\n")
        if parts[0] not in (b"GET", b"HEAD"):
            return _answer(b"405 Method Not Allowed", b"use GET\n", extra=b"Allow: GET, HEAD\r\n")
        try:
            body = self.exposition()
        except Exception:
            log.exception("metrics exposition failed")
            return _answer(b"500 Internal Server Error", b"the exposition failed: see the daemon's log\n")
        return _answer(b"200 OK", body, content_type=CONTENT_TYPE, head_only=parts[0] == b"HEAD")

    def _write(self, sock: socket.socket, events: int) -> None:
        conn = self._open.get(sock)
        if conn is None:
            return
        try:
            sent = sock.send(conn.out)
        except BlockingIOError:
            return
        except OSError:
            self._drop(conn)
            return
        conn.out = conn.out[sent:]
        if not conn.out:
            self._drop(conn)

    def _drop(self, conn: _Connection) -> None:
        if self._open.pop(conn.sock, None) is None:
            return
        if conn.state == "due":
            self._due.remove(conn)
        else:
            self._selector.unregister(conn.sock)
        conn.sock.close()
        if not self._closing:
            self._accept_more(True)
