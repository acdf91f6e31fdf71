"""A worker's output: relayed to the daemon's log as it comes (the worker logs JSON lines), and
its last lines kept for crash reports."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

TAIL_LINES = 100
LINE_CHARS = 2000  # a longer line is kept by its end, where the error usually is


class WorkerOutput:
    def __init__(self, relay: Callable[[bytes], None]):
        self.relay = relay
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._partial = b""

    def new_worker(self) -> None:
        self.tail.clear()
        self._partial = b""

    def feed(self, chunk: bytes) -> None:
        self.relay(chunk)
        *lines, partial = (self._partial + chunk).split(b"\n")
        self._partial = partial[-65536:]  # a worker printing without newlines
        self.tail.extend(line.decode(errors="replace")[-LINE_CHARS:] for line in lines)

    def ended(self) -> None:
        """The worker's output closed: its last line counts even without a newline."""
        if self._partial:
            self.tail.append(self._partial.decode(errors="replace")[-LINE_CHARS:])
            self._partial = b""

    def last_error(self) -> str | None:
        """The worker's last error line (a JSON error record, or a traceback's plain text)."""
        for line in reversed(self.tail):
            if '"level": "error"' in line or "Traceback" in line or "Error" in line[:80]:
                return line
        return None
