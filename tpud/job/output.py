"""A worker's output: relayed to the daemon's log as it comes (the worker logs JSON lines), and
its last lines kept for crash reports."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from tpud.job.health.crashes import json_record

TAIL_LINES = 100
LINE_CHARS = 2000  # a longer line is kept by its end, where the error usually is


class WorkerOutput:
    def __init__(self, relay: Callable[[bytes], None]):
        self.relay = relay
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._partial = self._unrelayed = b""

    def new_worker(self) -> None:
        self.tail.clear()
        self._partial = self._unrelayed = b""

    def feed(self, chunk: bytes) -> None:
        # Whole lines only: the processes of one job (device.processes_per_host) share the relay,
        # and a line cut between two chunks would be spliced with another process's.
        pending = self._unrelayed + chunk
        cut = pending.rfind(b"\n") + 1
        if len(pending) - cut > 65536:  # a worker printing without newlines: passed on as it comes
            cut = len(pending)
        if cut:
            self.relay(pending[:cut])
        self._unrelayed = pending[cut:]
        *lines, partial = (self._partial + chunk).split(b"\n")
        self._partial = partial[-65536:]  # a worker printing without newlines
        self.tail.extend(line.decode(errors="replace")[-LINE_CHARS:] for line in lines)

    def ended(self) -> None:
        """The worker's output closed: its last line counts even without a newline, and is relayed
        with one. A worker killed between a record and its newline (unbuffered output writes them
        apart) would otherwise have the next line, any process's, spliced onto that record."""
        if self._unrelayed:
            self.relay(self._unrelayed + b"\n")
            self._unrelayed = b""
        if self._partial:
            self.tail.append(self._partial.decode(errors="replace")[-LINE_CHARS:])
            self._partial = b""

    def last_error(self) -> str | None:
        """The worker's last error line (a JSON error record, or a traceback's plain text), as an
        operator reads it in `tpud status`."""
        for line in reversed(self.tail):
            if '"level": "error"' in line or "Traceback" in line or "Error" in line[:80]:
                return readable(line)
        return None


def readable(line: str) -> str:
    """A JSON log record as its event and its fields (`event (key=value, ...)`); any other line as it
    is. The level and time say nothing in an error, and a logged traceback is shown by its last line."""
    record = json_record(line.strip())
    if record is None or not isinstance(record.get("event"), str):
        return line
    fields = []
    for key, value in record.items():
        if key == "exception" and isinstance(value, str) and value.strip():
            value = value.strip().splitlines()[-1]
        if key not in ("event", "level", "timestamp"):
            fields.append(f"{key}={value}")
    return record["event"] + (f" ({', '.join(fields)})" if fields else "")
