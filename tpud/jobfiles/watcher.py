"""Noticing that the jobs directory may have changed.

`Watcher(directory, on_change)` calls `on_change()` when the directory may have changed: after
a burst of file-system events has been quiet for `debounce_s` (so a save by write-temp-then-
rename is seen once, complete), and every `rescan_s` regardless, as a backstop for what
inotify cannot see (network file systems, a directory deleted and recreated, includes that
live elsewhere). It never says *what* changed: the caller rescans (jobfiles/reading.py) and
reconciles. Call `start()` first and scan after it, so no change falls between the two.

Torch-free: the daemon imports this.
"""

from __future__ import annotations

import contextlib
import math
import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

import structlog
from watchdog import events as _events
from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver, ObservedWatch

__all__ = ["Watcher"]

log = structlog.get_logger()


# Event kinds that can change what scan() returns. Not opened / closed-without-writing:
# scan()'s own reads produce those, and reacting to them would loop.
_EVENT_FILTER: list[type[FileSystemEvent]] = [
    cls
    for name in (
        "FileCreatedEvent", "DirCreatedEvent", "FileModifiedEvent", "DirModifiedEvent",
        "FileMovedEvent", "DirMovedEvent", "FileDeletedEvent", "DirDeletedEvent",
        "FileClosedEvent", "FileAttribEvent", "DirAttribEvent",  # not in every watchdog >= 4
    )
    if (cls := getattr(_events, name, None)) is not None
]
_EVENT_TYPES = frozenset({"created", "modified", "moved", "deleted", "closed", "attrib"})


class _Handler(FileSystemEventHandler):
    def __init__(self, poke: Callable[[], None]):
        self._poke = poke

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type in _EVENT_TYPES:
            self._poke()


class Watcher:
    """Calls `on_change()` (from its own thread) when the jobs directory may have changed.

    Any create/modify/move/delete event in the directory starts or extends a quiet period of
    `debounce_s`; when it ends, `on_change()` is called once. A burst that never goes quiet
    still fires after `10 * debounce_s` (at least 1 s). Independently, `on_change()` is called
    whenever `rescan_s` has passed without a call. Every `poll_s` the watcher checks that its
    inotify watch is still on the directory at `directory`; when the directory was deleted,
    replaced or could not be watched, it re-arms as soon as it can and calls `on_change()`.
    `on_change` must be quick and thread-safe (set a flag, wake a loop); its exceptions are
    logged and swallowed.
    """

    def __init__(
        self,
        directory: Path,
        on_change: Callable[[], None],
        *,
        debounce_s: float = 0.3,
        rescan_s: float = 30.0,
        poll_s: float = 1.0,
    ):
        if debounce_s < 0 or rescan_s <= 0 or poll_s <= 0:
            raise ValueError("debounce_s must be >= 0, rescan_s and poll_s > 0")
        self.directory = Path(directory)
        self.on_change = on_change
        self.debounce_s = debounce_s
        self.rescan_s = rescan_s
        self.poll_s = poll_s
        self.max_delay_s = max(10 * debounce_s, 1.0)

        self._cond = threading.Condition()
        self._due: float | None = None  # when the pending debounced call fires
        self._burst_start: float | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None

        # Owned by the watcher's thread once started (start() arms it before that).
        self._observer: BaseObserver | None = None
        self._watch: ObservedWatch | None = None
        self._identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the watched directory
        self._warned: str | None = None

    # --- lifecycle ---

    def start(self) -> None:
        """Create the directory (and its parents) if needed and start watching."""
        with self._cond:
            if self._thread is not None:
                raise RuntimeError("Watcher already started")
            self._stopping = False
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            observer = Observer()
            observer.start()
            self._observer = observer
        except OSError as e:  # e.g. fs.inotify.max_user_instances reached
            log.warning("jobs directory: cannot watch for changes, rescanning every rescan_s",
                        path=str(self.directory), error=str(e), rescan_s=self.rescan_s)
        self._rearm()
        self._thread = threading.Thread(target=self._run, name="tpud-watcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching and join the watcher's threads. No on_change() call starts after this."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        observer, self._observer = self._observer, None
        self._watch = None
        if observer is not None:
            observer.stop()
            if observer is not threading.current_thread():
                with contextlib.suppress(RuntimeError):
                    observer.join()

    def __enter__(self) -> Watcher:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- internals ---

    def _poke(self) -> None:
        """A file-system event: start or extend the quiet period."""
        now = time.monotonic()
        with self._cond:
            if self._burst_start is None:
                self._burst_start = now
            self._due = min(now + self.debounce_s, self._burst_start + self.max_delay_s)
            self._cond.notify_all()

    def _run(self) -> None:
        last_call = time.monotonic()
        next_poll = last_call + self.poll_s
        while True:
            with self._cond:
                while True:
                    if self._stopping:
                        return
                    now = time.monotonic()
                    due = math.inf if self._due is None else self._due
                    fire_at = min(due, last_call + self.rescan_s)
                    fire, poll = now >= fire_at, now >= next_poll
                    if fire or poll:
                        break
                    self._cond.wait(min(fire_at, next_poll) - now)
                if fire:
                    self._due = self._burst_start = None
            if poll:
                next_poll = now + self.poll_s
                if self._rearm():
                    self._poke()
            if fire:
                try:
                    self.on_change()
                except Exception:
                    log.exception("jobs directory: on_change failed")
                last_call = time.monotonic()

    def _rearm(self) -> bool:
        """Make sure the watch is on the directory now at the path. True if that changed.

        Called without holding self._cond: the observer holds its own lock while it calls
        our handler, which takes self._cond.
        """
        try:
            st = os.stat(self.directory)
            identity = (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None
        except OSError:
            identity = None
        if identity is not None and identity == self._identity and (self._observer is None or self._watching()):
            return False

        if self._watch is not None and self._observer is not None:
            with contextlib.suppress(Exception):
                self._observer.unschedule(self._watch)
        self._watch = None
        changed = identity != self._identity
        self._identity = identity
        if identity is None:
            self._warn_once("missing", "jobs directory is missing; waiting for it to reappear")
            return changed
        if self._observer is not None:
            try:
                self._watch = self._observer.schedule(
                    _Handler(self._poke), str(self.directory),
                    recursive=False, event_filter=_EVENT_FILTER, follow_symlink=True,
                )
            except OSError as e:  # e.g. fs.inotify.max_user_watches reached; retried every poll_s
                self._warn_once("unwatchable", "jobs directory: cannot watch for changes, will retry", error=str(e))
                return changed
        if self._warned is not None:
            log.info("jobs directory: watching again", path=str(self.directory))
            self._warned = None
        return True

    def _watching(self) -> bool:
        """Whether our watch's emitter still runs (it stops when the directory is deleted)."""
        if self._watch is None or self._observer is None:
            return False
        with contextlib.suppress(RuntimeError):  # the set changing under us: check next time
            for emitter in list(self._observer.emitters):
                if emitter.watch == self._watch:
                    return emitter.is_alive()
        return False

    def _warn_once(self, kind: str, message: str, **fields: object) -> None:
        if self._warned != kind:
            log.warning(message, path=str(self.directory), **fields)
            self._warned = kind
