"""Reads the daemon's loop must never wait for, done on a thread of their own.

The loop answers `tpud status` and pings systemd's watchdog. Parsing a job file is bounded
(engine.specfile.LIMITS) but can still take a second for a large or hostile one, and a
directory may hold many; so the daemon reads jobs.d and tpud.yaml here and the loop only
receives the results, in the order the reads ran. One thread, first come first served; a
read asked for again before it started runs once. The thread is a daemon thread: a read
stuck in the kernel (a hung network file system) never holds up the daemon's exit.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import structlog

log = structlog.get_logger()


class OffLoop:
    def __init__(self, post: Callable[[Callable[[], None]], None]):
        """`post(fn)` runs fn on the loop thread (the daemon's post)."""
        self._post = post
        self._tasks: queue.SimpleQueue[tuple[str, Callable[[], Any], Callable[[Any], None]] | None] = queue.SimpleQueue()
        self._queued: set[str] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="tpud-reader", daemon=True)
        self._thread.start()

    def submit(self, name: str, read: Callable[[], Any], then: Callable[[Any], None]) -> None:
        """Run `read()` here, then `then(result)` on the loop; a no-op while `name` waits to start."""
        with self._lock:
            if self._closed or name in self._queued:
                return
            self._queued.add(name)
        self._tasks.put((name, read, then))

    def _run(self) -> None:
        while (task := self._tasks.get()) is not None:
            name, read, then = task
            with self._lock:
                self._queued.discard(name)
            try:
                result = read()
            except Exception:  # noqa: BLE001 - a strange file must never stop later reads
                log.exception("background read failed", read=name)
                continue
            self._post(lambda then=then, result=result: then(result))

    def close(self) -> None:
        """Start nothing more; a read in progress finishes on its own (its result is dropped)."""
        with self._lock:
            self._closed = True
        self._tasks.put(None)
