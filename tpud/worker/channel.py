"""The per-job channel between the daemon and its worker: a Unix socket, JSON lines.

Every line is one message of engine/events.py: the worker sends hello, heartbeats, step and
checkpoint events; the daemon sends requests (checkpoint, checkpoint_and_exit, stop, each with
an optional deadline). Lines that are not a message this version knows are dropped.

The daemon listens on <runtime>/jobs/<job>.sock before it starts the worker and passes
the path in TPUD_CHANNEL. Signals stay the fallback (SIGTERM, SIGUSR1), so a worker whose
channel broke can still be stopped cleanly. Torch-free on the daemon side.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from engine import events

MAX_LINE = 1 << 20
HEARTBEAT_EVERY_S = 1.0


class Connection:
    """One end of the channel, non-blocking: feed it readable bytes, take whole messages."""

    def __init__(self, sock: socket.socket):
        sock.setblocking(False)
        self.sock, self._buffer = sock, b""

    def fileno(self) -> int:
        return self.sock.fileno()

    def receive(self) -> list[events.Event] | None:
        """Messages now readable; None once the peer has closed the connection."""
        try:
            data = self.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            return None
        if not data:
            return None
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        if len(self._buffer) > MAX_LINE:
            return None  # a peer that never ends its line is not speaking this protocol
        messages = []
        for line in lines:
            try:
                message = events.decode(json.loads(line))
            except (ValueError, RecursionError):  # RecursionError: a line of 100,000 nested brackets
                continue
            if message is not None:
                messages.append(message)
        return messages

    def send(self, message: events.Event) -> bool:
        data = (json.dumps(message.to_json()) + "\n").encode()
        try:
            self.sock.setblocking(True)
            self.sock.settimeout(1.0)
            self.sock.sendall(data)
            return True
        except OSError:
            return False
        finally:
            try:
                self.sock.setblocking(False)
            except OSError:
                pass

    def close(self) -> None:
        self.sock.close()


class Listener:
    """The daemon's listening socket for one job."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
        path.unlink(missing_ok=True)
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        os.chmod(path, 0o600)
        self.sock.listen(4)
        self.sock.setblocking(False)

    def fileno(self) -> int:
        return self.sock.fileno()

    def accept(self) -> Connection | None:
        try:
            sock, _ = self.sock.accept()
        except (BlockingIOError, InterruptedError):
            return None
        return Connection(sock)

    def close(self) -> None:
        self.sock.close()
        self.path.unlink(missing_ok=True)


def connect(path: str) -> Connection | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        return None
    return Connection(sock)


class HeartbeatClock:
    """Rate-limits heartbeats: the loop polls at every micro-batch, the daemon needs ~1/s."""

    def __init__(self, every: float = HEARTBEAT_EVERY_S, clock=time.monotonic):
        self.every, self.clock, self._last = every, clock, float("-inf")

    def due(self) -> bool:
        now = self.clock()
        if now - self._last >= self.every:
            self._last = now
            return True
        return False


class Link:
    """The daemon's end of one worker's channel, on its event loop: listens, accepts the
    worker's connection (a newer one replaces an older), hands each event on, sends requests."""

    def __init__(self, path: Path, loop, on_event):
        """loop: watch(fileobj, callback) / unwatch(fileobj); on_event(event) for each event received."""
        self.loop, self.on_event = loop, on_event
        self.listener: Listener | None = Listener(path)
        self.connection: Connection | None = None
        loop.watch(self.listener, self._accept)

    def send(self, message: events.Event) -> bool:
        return self.connection is not None and self.connection.send(message)

    def _accept(self) -> None:
        connection = self.listener.accept() if self.listener is not None else None
        if connection is None:
            return
        self._drop_connection()
        self.connection = connection
        self.loop.watch(connection, self._receive)

    def _receive(self) -> None:
        if self.connection is None:
            return
        received = self.connection.receive()
        if received is None:
            self._drop_connection()
            return
        for event in received:
            self.on_event(event)

    def _drop_connection(self) -> None:
        if self.connection is not None:
            self.loop.unwatch(self.connection)
            self.connection.close()
            self.connection = None

    def close(self) -> None:
        self._drop_connection()
        if self.listener is not None:
            self.loop.unwatch(self.listener)
            self.listener.close()
            self.listener = None

