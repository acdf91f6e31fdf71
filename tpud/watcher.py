"""Which job files exist and what they say.

`scan(directory)` reads every job file (`*.yaml`, `*.yml`) directly in the jobs directory and
returns one `JobFile` per file: its path, the sha256 of its bytes, and either the validated
`JobSpec` or the error (`FILE:LINE: KEY: MESSAGE` lines, as `tpud validate` prints them).
Editor droppings (swap, backup, lock and temp files) and dot files are not job files.

`Watcher(directory, on_change)` calls `on_change()` when the directory may have changed: after
a burst of file-system events has been quiet for `debounce_s` (so a save by write-temp-then-
rename is seen once, complete), and every `rescan_s` regardless, as a backstop for what
inotify cannot see (network file systems, a directory deleted and recreated, includes that
live elsewhere). It never says *what* changed: the caller rescans and reconciles. Call
`start()` first and `scan()` after it, so no change falls between the two.

Torch-free: the daemon imports this.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import re
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog
from watchdog import events as _events
from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver, ObservedWatch

from engine.config import JobSpec
from engine.specfile import Problem, Refused, SpecError, load_spec, read_regular_file

__all__ = ["JOB_SUFFIXES", "JobFile", "Watcher", "is_job_file", "scan"]

log = structlog.get_logger()

JOB_SUFFIXES = (".yaml", ".yml")

# Names that are never job files even when they end in .yaml: editor and package-manager
# droppings. Dot files (.#x emacs locks, .x.swp vim swap, .x.tmp123 temp files) go by the
# leading dot.
_IGNORED_PREFIXES = (".", "#")  # .hidden, .#x (emacs lock), #x# (emacs autosave)
_IGNORED_SUFFIXES = ("~", "#", ".swp", ".swo", ".swx", ".tmp", ".bak", ".orig", ".rej", ".part")
_IGNORED_NAMES = frozenset({"4913"})  # vim's probe file
_IGNORED_INFIXES = (".dpkg-", ".ucf-", ".rpmnew", ".rpmsave")


def is_job_file(name: str) -> bool:
    """Whether a directory entry's name is a job file (not a dot file or an editor's leftover)."""
    if name in _IGNORED_NAMES or name.startswith(_IGNORED_PREFIXES) or name.endswith(_IGNORED_SUFFIXES):
        return False
    if any(infix in name for infix in _IGNORED_INFIXES):
        return False
    return name.endswith(JOB_SUFFIXES) and name not in JOB_SUFFIXES


@dataclass(frozen=True)
class JobFile:
    """One job file as last read. Exactly one of `spec` and `error` is set.

    `digest` is the sha256 (hex) of the file's own bytes ("" when it could not be read); it
    does not cover files the job `include:`s, so compare `spec` too to see every change.
    `spec` may be shared with later scans (cached): treat it as read-only.
    """

    path: Path
    digest: str
    spec: JobSpec | None
    error: str | None

    def __post_init__(self) -> None:
        if (self.spec is None) == (self.error is None):
            raise ValueError("a JobFile has exactly one of spec and error")

    @property
    def ok(self) -> bool:
        return self.spec is not None


# (path, digest) -> (spec, error). Only files without `include:` are cached: an included
# file can change while the including file's bytes stay the same.
_cache: dict[tuple[Path, str], tuple[JobSpec | None, str | None]] = {}
_cache_lock = threading.Lock()
_READ_ATTEMPTS = 3


def scan(directory: Path) -> dict[Path, JobFile]:
    """Every job file directly in `directory`, keyed by path, in sorted order.

    A file that vanishes while being read is left out; one that cannot be read (a directory,
    FIFO or device named like a job file, a file over the size limit), or does not hold a
    valid job, is there with its error. A missing directory holds no job files. When
    two files declare the same job name, the later path (sorted) gets the error.
    """
    directory = Path(directory)
    try:
        with os.scandir(directory) as entries:
            names = sorted(entry.name for entry in entries if is_job_file(entry.name))
    except (FileNotFoundError, NotADirectoryError):
        names = []

    found: dict[Path, JobFile] = {}
    for name in names:
        job = _read_job(directory / name)
        if job is not None:
            found[job.path] = job

    with _cache_lock:  # forget versions of this directory's files that are gone
        keep = {(job.path, job.digest) for job in found.values()}
        for key in [k for k in _cache if k[0].parent == directory and k not in keep]:
            del _cache[key]

    owners: dict[str, Path] = {}
    for path, job in found.items():
        if job.spec is None:
            continue
        owner = owners.setdefault(job.spec.name, path)
        if owner != path:
            problem = Problem(str(path), key_line(path, "name", top_level=True), "name",
                              f"job {job.spec.name} is already defined in {owner}")
            found[path] = JobFile(path, job.digest, None, str(problem))
    return found


def _read_job(path: Path) -> JobFile | None:
    """The job file at `path`, or None when it no longer exists."""
    raw = _read_bytes(path)
    for _ in range(_READ_ATTEMPTS):
        if isinstance(raw, JobFile) or raw is None:
            return raw
        digest = hashlib.sha256(raw).hexdigest()
        cacheable = _cacheable(raw)
        with _cache_lock:
            hit = _cache.get((path, digest)) if cacheable else None
        if hit is not None:
            return JobFile(path, digest, *hit)

        spec, error = _parse(path)
        # load_spec read the file again: keep the result only if that was the same version.
        again = _read_bytes(path)
        if isinstance(again, bytes) and again == raw:
            if cacheable:
                with _cache_lock:
                    _cache[(path, digest)] = (spec, error)
            return JobFile(path, digest, spec, error)
        raw = again
    if isinstance(raw, bytes):
        digest = hashlib.sha256(raw).hexdigest()
        return JobFile(path, digest, None, f"{path}: the file kept changing while it was being read")
    return raw


def _read_bytes(path: Path) -> bytes | JobFile | None:
    """The file's bytes; a JobFile with the error when it cannot be a job file (a FIFO, a
    device, a directory, too large: refused without a blocking read); None when it is gone."""
    try:
        return read_regular_file(path)
    except FileNotFoundError:
        if os.path.islink(path):  # a dangling symlink is a job file that cannot be read
            return JobFile(path, "", None, f"{path}: cannot read: the symlink's target does not exist")
        return None  # removed between listing and reading
    except OSError as e:
        return JobFile(path, "", None, f"{path}: cannot read: {e.strerror or e}")
    except Refused as e:
        return JobFile(path, "", None, f"{path}: cannot read: {e}")


def _parse(path: Path) -> tuple[JobSpec | None, str | None]:
    try:
        return load_spec(path), None
    except SpecError as e:
        return None, str(e)
    except Exception as e:  # noqa: BLE001 - a strange file must never take the daemon down
        log.exception("job file: unexpected error while loading", path=str(path))
        return None, f"{path}: cannot load: {type(e).__name__}: {e}"


def _cacheable(raw: bytes) -> bool:
    # Not cached: files that may name an include (its content is not in the digest), and
    # files that are not plain UTF-8 (the include check could not see the key in them).
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return "\x00" not in text and "include" not in text


def key_line(path: Path, key: str, *, top_level: bool = False) -> int | None:
    """The first line of `path` that spells out `key:` plainly (at column 0 with top_level), for
    messages about a key that validated but may not run here."""
    indent = "" if top_level else r"[ \t]*"
    pattern = re.compile(rf"""^{indent}["']?{re.escape(key)}["']?\s*:""", re.MULTILINE)
    with contextlib.suppress(OSError, Refused, UnicodeDecodeError):
        text = read_regular_file(path).decode("utf-8")
        match = pattern.search(text)
        if match:
            return text.count("\n", 0, match.start()) + 1
    return None


# --- Watching ---

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
