"""remote_jobs: a watched directory in GCS, mirrored into this host's state directory.

Every daemon with `remote_jobs: gs://bucket/prefix/` in tpud.yaml polls that prefix (its job
files directly under it) every `remote_jobs_poll_seconds`, from a thread of its own: one listing
with each object's generation and size, and no download when nothing changed. An object that is
new or has a new generation is downloaded (at most LIMITS.file_bytes + 1 bytes: a larger one
stays over the limit and is refused like a local file, never read whole) into the mirror
directory, written to a temporary name first and renamed; an object gone from a listing is
removed from the mirror. Then `on_change()` is called and the daemon rescans jobs.d and the
mirror together (jobfiles/reading.py): a remote job file gets everything a local one gets.

A listing that fails (the bucket unreachable, slow, or refusing) changes nothing: the mirror
keeps what it holds, so the jobs running from it go on. The error is logged once, shown by
`status()`, and the poll is retried with a doubling backoff up to BACKOFF_MAX_S; the first listing
that succeeds again is logged too. Each request is bounded (REQUEST_TIMEOUT_S), and nothing here
runs on the daemon's loop.

The generations the mirror holds are recorded beside it (GENERATIONS), so a restarted daemon
downloads only what changed meanwhile, and `tpud status` shows which generation each host runs.
Torch-free: the daemon imports this.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from engine.spec.loader import LIMITS
from tpud.jobfiles.reading import is_job_file

log = structlog.get_logger()

GENERATIONS = ".generations.json"  # a dot file: never a job file
REQUEST_TIMEOUT_S = 10.0
BACKOFF_MAX_S = 30.0


def split_url(url: str) -> tuple[str, str]:
    """(bucket, prefix with its trailing slash, or "") of gs://bucket[/prefix][/]."""
    if not url.startswith("gs://") or not url[5:].split("/", 1)[0]:
        raise ValueError(f"not a gs://bucket[/prefix] URL: {url!r}")
    bucket, _, prefix = url[5:].partition("/")
    return bucket, (prefix.strip("/") + "/") if prefix.strip("/") else ""


class RemoteJobs:
    """Mirrors the job files under `url` into `mirror`, calling `on_change()` when the mirror changed."""

    def __init__(self, url: str, mirror: Path, on_change: Callable[[], None], *, poll_s: float = 5.0,
                 client: Callable[[], object] | None = None, clock: Callable[[], float] = time.monotonic):
        self.url, self.mirror, self.on_change, self.poll_s = url, Path(mirror), on_change, poll_s
        self.bucket_name, self.prefix = split_url(url)
        self._client_factory = client or _default_client
        self._client = None
        self._clock = clock
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.generations: dict[str, int] = self._recorded()
        self.error: str | None = None  # the last listing's error, None once one succeeds
        self.last_listed: float | None = None  # time.time() of the last listing that succeeded

    # --- lifecycle ---

    def start(self) -> None:
        self.mirror.mkdir(parents=True, exist_ok=True)
        for entry in self.mirror.iterdir():  # a file whose generation went unrecorded (a crash between the two)
            if is_job_file(entry.name) and entry.name not in self.generations:
                entry.unlink()
        self._thread = threading.Thread(target=self._run, name="tpud-remote-jobs", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:  # a request in flight ends within its timeout; the thread is a daemon's
            self._thread.join(timeout=REQUEST_TIMEOUT_S)

    def poke(self) -> None:
        """Poll now (SIGHUP, tests), not at the next interval."""
        with self._cond:
            self._cond.notify_all()

    def status(self) -> dict:
        return {"url": self.url, "error": self.error, "last_listed": self.last_listed,
                "generations": dict(self.generations)}

    # --- the poller ---

    def _run(self) -> None:
        delay = self.poll_s
        while True:
            try:
                changed = self.poll()
            except Exception as e:  # noqa: BLE001 - any failure of the bucket: keep the mirror, retry later
                if self.error is None:
                    log.warning("remote jobs: cannot list; the jobs from there go on as they are", url=self.url,
                                error=_describe(e), retry_s=delay)
                self.error = _describe(e)
                delay = min(delay * 2, BACKOFF_MAX_S)
            else:
                if self.error is not None:
                    log.info("remote jobs: listed again", url=self.url)
                self.error, delay = None, self.poll_s
                if changed:
                    try:
                        self.on_change()
                    except Exception:
                        log.exception("remote jobs: on_change failed")
            with self._cond:
                if not self._stopping:
                    self._cond.wait(delay)
                if self._stopping:
                    return

    def poll(self) -> bool:
        """One listing, and the mirror brought in line with it. Whether the mirror changed."""
        client = self._client = self._client or self._client_factory()
        listed = {}
        for blob in client.list_blobs(self.bucket_name, prefix=self.prefix, delimiter="/",
                                      timeout=REQUEST_TIMEOUT_S, retry=None):
            name = blob.name[len(self.prefix):]
            if is_job_file(name):
                listed[name] = blob
        self.last_listed = time.time()
        changed = False
        for name, blob in listed.items():
            if self.generations.get(name) != blob.generation or not (self.mirror / name).exists():
                changed |= self._download(blob, name)
        for name in set(self.generations) - set(listed):
            with contextlib.suppress(FileNotFoundError):
                (self.mirror / name).unlink()
            del self.generations[name]
            changed = True
        if changed:
            self._record()
        return changed

    def _download(self, blob, name: str) -> bool:
        """The object's bytes into the mirror; False when it changed or went since the listing (the
        next poll sees what it became)."""
        from google.api_core.exceptions import NotFound, PreconditionFailed

        try:  # one byte past the limit is enough for the reader to refuse the file as too large
            data = blob.download_as_bytes(start=0, end=LIMITS.file_bytes, timeout=REQUEST_TIMEOUT_S, retry=None,
                                          if_generation_match=blob.generation)
        except (NotFound, PreconditionFailed):
            return False
        _write_atomically(self.mirror / name, data)
        self.generations[name] = blob.generation
        log.info("remote jobs: job file fetched", file=f"{self.url.rstrip('/')}/{name}", generation=blob.generation,
                 bytes=len(data))
        return True

    def _recorded(self) -> dict[str, int]:
        try:
            recorded = json.loads((self.mirror / GENERATIONS).read_text())
            return {str(k): int(v) for k, v in recorded.items() if is_job_file(str(k))}
        except (OSError, ValueError, AttributeError):
            return {}

    def _record(self) -> None:
        _write_atomically(self.mirror / GENERATIONS, json.dumps(self.generations, sort_keys=True).encode())


def _write_atomically(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        with open(temporary, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except OSError:  # a full disk: the copy the mirror held stays, and no half-written file is left
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise


def _default_client():
    from tpud.gcs.tier import make_client

    return make_client()


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
