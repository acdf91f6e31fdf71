"""Reads the daemon's loop must never wait for, done on a thread of their own.

The loop answers `tpud status` and pings systemd's watchdog. Parsing a job file is bounded
(engine.specfile.LIMITS) but can still take a second for a large or hostile one, and a
directory may hold many; so the daemon reads jobs.d and tpud.yaml here and the loop only
receives the results. One thread, first come first served: a reload's settings are in
place before the scan that follows it. A read asked for again before it started runs once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import structlog

log = structlog.get_logger()
T = TypeVar("T")


class OffLoop:
    def __init__(self, post: Callable[[Callable[[], None]], None]):
        """`post(fn)` runs fn on the loop thread (the daemon's post)."""
        self._post = post
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tpud-reader")
        self._queued: set[str] = set()
        self._lock = threading.Lock()

    def submit(self, name: str, read: Callable[[], T], then: Callable[[T], None]) -> None:
        """Run `read()` here, then `then(result)` on the loop; a no-op while `name` waits to start."""
        with self._lock:
            if name in self._queued:
                return
            self._queued.add(name)

        def task() -> None:
            with self._lock:
                self._queued.discard(name)
            try:
                result = read()
            except Exception:  # noqa: BLE001 - a strange file must never stop later reads
                log.exception("background read failed", read=name)
                return
            self._post(lambda: then(result))

        try:
            self._executor.submit(task)
        except RuntimeError:  # shut down: the daemon is exiting
            with self._lock:
                self._queued.discard(name)

    def close(self) -> None:
        """Start nothing more; a read in progress finishes on its own (its result is dropped)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
