"""The supervisor's GCS uploads for one job: a background thread, so an upload outlives the
worker that wrote the checkpoint (torch-free).

- `submit(step_dir)` after each local commit. One upload runs at a time. Newest wins: while
  one uploads, further submissions wait in a single slot, and a newer step replaces an older
  one there (the dropped step is never uploaded: the remote tier only needs recent steps to
  resume from, and each upload is a whole step). The upload in progress is never cancelled.
- `interval` (checkpoint.remote_interval_seconds): an upload begins at most once per interval,
  counted from when the last began; auto, a `SecondsPolicy` fed with each upload's time. An
  urgent submission (a final, requested or preemption save) and `wait` upload at once.
- After each upload the remote retention runs (`keep` steps).
- A failed upload is logged, counted, and retried later with backoff unless a newer step
  has been submitted meanwhile, the step is no longer committed locally, or the failure is
  a RemoteConflict (permanent: a different step N is already committed remotely). Nothing
  here ever raises into the supervisor.
- Steps queued or uploading are pinned (engine.checkpoint.manifest.pin: <job_dir>/.pins/N),
  which the worker's local retention honours; `protected_steps()` says the same in-process.
  start() clears pins a crashed supervisor left behind; the uploader owns the job's pins.
- `wait(timeout)`: the stop path's "let pending uploads finish" (a backing-off retry is
  tried at once).

`ensure_newest_local()` runs before a worker starts: on a fresh host it downloads the
newest remote step when that is newer than the newest valid local one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from engine.backoff import Backoff
from engine.checkpoint.policy import Interval, SecondsPolicy
from engine.checkpoint.manifest import PINS, pin, read_manifest, step_dir_name, unpin
from tpud.gcs.tier import GcsTier, RemoteConflict, Transfer, newest_valid_local

log = structlog.get_logger()

Key = tuple[int, int]  # (step, micro_step): the order of checkpoints


@dataclass(frozen=True)
class UploaderStats:
    uploaded: int                # steps uploaded (or found already committed remotely)
    failures: int                # failed upload attempts (each retry counts)
    retention_failures: int
    bytes: int                   # bytes transferred
    last: str | None             # newest step directory committed remotely by this uploader
    last_error: str | None       # None after a success
    uploading: str | None        # step directory now uploading
    queued: str | None           # step directory waiting for the slot


class Uploader:
    """Background uploads of one job's committed local steps (in local_job_dir) to its GcsTier."""

    def __init__(self, tier: GcsTier, local_job_dir: Path, keep: int, *, retry_initial: float = 5.0,
                 retry_maximum: float = 300.0, on_result: Callable[[Key, Transfer | None], None] | None = None,
                 interval: float | SecondsPolicy = 0.0):
        """on_result(key, transfer) after each attempt, from the uploader's thread; transfer is
        None when the attempt failed. interval: seconds between the starts of uploads, or a policy."""
        self.tier = tier
        self.interval = interval
        self.on_result = on_result
        self.local_job_dir = Path(local_job_dir)
        self.keep = keep
        self.retry_initial = retry_initial
        self.retry_maximum = retry_maximum
        self._cond = threading.Condition()
        self._queued: tuple[Key, Path] | None = None
        self._uploading: tuple[Key, Path] | None = None
        self._not_before = 0.0          # monotonic time before which a failed step is not retried
        self._retries = 0               # consecutive failures of the queued step
        self._hurry = False             # wait() is waiting: retry within a second
        self._urgent = False            # the queued step uploads whatever the interval
        self._began: float | None = None  # monotonic time the last upload began
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._uploaded = self._failures = self._retention_failures = self._bytes = 0
        self._last: Key | None = None
        self._last_error: str | None = None

    # -- the supervisor's side ----------------------------------------------------------

    def start(self) -> Uploader:
        with self._cond:
            if self._thread is None:
                pins = self.local_job_dir / PINS
                if pins.is_dir():
                    for stale in pins.iterdir():
                        stale.unlink(missing_ok=True)
                self._thread = threading.Thread(target=self._run, name=f"gcs-upload-{self.tier.job}", daemon=True)
                self._thread.start()
        return self

    def submit(self, step_dir: Path, *, urgent: bool = False) -> None:
        """Queue a committed local step directory for upload (newest wins; never raises); urgent:
        at once, whatever the interval."""
        step_dir = Path(step_dir)
        manifest = read_manifest(step_dir)
        if manifest is None:
            log.warning("gcs upload: not a committed step directory, ignored", path=str(step_dir))
            return
        key = (manifest.step, manifest.micro_step)
        with self._cond:
            newest_held = max([k for k in (self._last, self._held_key(self._uploading),
                                           self._held_key(self._queued)) if k is not None], default=None)
            if newest_held is not None and key <= newest_held:
                return
            dropped, self._queued = self._queued, (key, step_dir)
            self._not_before, self._retries = 0.0, 0
            self._urgent = self._urgent or urgent
            self._pin(key)
            if dropped is not None:
                log.info("gcs upload superseded", job=self.tier.job, dropped=dropped[1].name, step=step_dir.name)
                self._unpin_unless_held(dropped[0])
            self._cond.notify_all()

    def protected_steps(self) -> frozenset[int]:
        """Steps queued or uploading: local retention must not delete these (the same set as
        the pins; ints, as engine.checkpoint.manifest.pinned_steps)."""
        with self._cond:
            return frozenset(held[0][0] for held in (self._uploading, self._queued) if held is not None)

    def is_protected(self, step: int) -> bool:
        return step in self.protected_steps()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued or uploading; True if so, False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._hurry = True  # a step backing off after a failure is retried within a second
            self._not_before = min(self._not_before, time.monotonic() + 1.0)
            self._cond.notify_all()
            try:
                while self._uploading is not None or self._queued is not None:
                    if self._thread is None or not self._thread.is_alive():
                        return False
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._cond.wait(left)
                return True
            finally:
                self._hurry = False

    def close(self, timeout: float | None = None) -> bool:
        """wait(timeout), then stop the thread and drop the pins. An upload still running is
        abandoned (its step stays uncommitted remotely; a later upload of it resumes, skipping
        objects already there). True if everything was uploaded."""
        done = self.wait(timeout)
        with self._cond:
            self._stopping = True
            for held in (self._uploading, self._queued):
                if held is not None:
                    unpin(self.local_job_dir, held[0][0])
            self._cond.notify_all()
        if self._thread is not None and done:
            self._thread.join(timeout=5)
        return done

    def policy(self) -> Interval | None:
        """The auto interval in force (None when the interval is a number of seconds)."""
        return self.interval.interval() if isinstance(self.interval, SecondsPolicy) else None

    @property
    def stats(self) -> UploaderStats:
        with self._cond:
            return UploaderStats(
                self._uploaded, self._failures, self._retention_failures, self._bytes,
                step_dir_name(*self._last) if self._last else None, self._last_error,
                self._uploading[1].name if self._uploading else None, self._queued[1].name if self._queued else None)

    # -- the thread ---------------------------------------------------------------------

    @staticmethod
    def _held_key(held: tuple[Key, Path] | None) -> Key | None:
        return held[0] if held is not None else None

    def _pin(self, key: Key) -> None:
        try:
            pin(self.local_job_dir, key[0])
        except OSError as e:
            log.warning("gcs upload: cannot pin the step", job=self.tier.job, step=key[0], error=str(e))

    def _unpin_unless_held(self, key: Key) -> None:
        """Unpin step key[0] unless another held entry (e.g. step N and N.0002) still needs it."""
        if any(held is not None and held[0][0] == key[0] for held in (self._uploading, self._queued)):
            return
        try:
            unpin(self.local_job_dir, key[0])
        except OSError as e:
            log.warning("gcs upload: cannot unpin the step", job=self.tier.job, step=key[0], error=str(e))

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._stopping:
                        return
                    if self._queued is not None:
                        now, start = time.monotonic(), max(self._not_before, self._due())
                        if start <= now:
                            break
                        self._cond.wait(start - now)
                    else:
                        self._cond.wait()
                self._uploading, self._queued = self._queued, None
                self._began, self._urgent = time.monotonic(), False
                key, step_dir = self._uploading
            try:
                retry = self._upload(key, step_dir)
            except BaseException as e:  # never into the supervisor; the thread must live on
                log.error("gcs uploader: unexpected error", job=self.tier.job, error=repr(e))
                retry = False
            with self._cond:
                self._uploading = None
                if retry and not self._stopping:
                    self._queued = (key, step_dir)
                else:
                    self._unpin_unless_held(key)
                self._cond.notify_all()

    def _due(self) -> float:
        """When the interval lets the next upload begin (the monotonic clock's time)."""
        if self._urgent or self._hurry or self._began is None:
            return 0.0
        policy = self.policy()
        return self._began + (self.interval if policy is None else policy.seconds)

    def _upload(self, key: Key, step_dir: Path) -> bool:
        """One attempt; True when the step should be retried later."""
        try:
            transfer = self.tier.upload_step(step_dir)
        except Exception as e:
            return self._failed(key, step_dir, e)
        with self._cond:
            self._uploaded += 1
            self._bytes += transfer.bytes
            self._last = max(key, self._last or key)
            self._last_error = None
        if isinstance(self.interval, SecondsPolicy):
            self.interval.save_took(transfer.seconds)
        self._report(key, transfer)
        try:
            deleted = self.tier.apply_retention(self.keep)
            if deleted:
                log.info("gcs retention", job=self.tier.job, deleted=deleted, keep=self.keep)
        except Exception as e:
            with self._cond:
                self._retention_failures += 1
            log.warning("gcs retention failed; tried again after the next upload", job=self.tier.job, error=str(e))
        return False

    def _report(self, key: Key, transfer: Transfer | None) -> None:
        if self.on_result is not None:
            try:
                self.on_result(key, transfer)
            except Exception as e:  # a reporting bug must not stop uploads
                log.error("gcs uploader: on_result failed", job=self.tier.job, error=repr(e))

    def _failed(self, key: Key, step_dir: Path, error: Exception) -> bool:
        retry = self._record_failure(step_dir, error)
        self._report(key, None)  # after the record: the callback may read stats.last_error
        return retry

    def _record_failure(self, step_dir: Path, error: Exception) -> bool:
        with self._cond:
            self._failures += 1
            self._last_error = f"{step_dir.name}: {error}"
            newer = self._queued is not None
            permanent = isinstance(error, RemoteConflict)
            gone = read_manifest(step_dir) is None
            if newer or permanent or gone:
                why = "a newer step is queued" if newer else "conflict" if permanent else "no longer committed locally"
                log.error("gcs upload failed; giving up on this step", job=self.tier.job, step=step_dir.name,
                          reason=why, error=str(error), failures=self._failures)
                return False
            self._retries += 1
            pause = Backoff(self.retry_initial, self.retry_maximum).delay(self._retries)
            if self._hurry:
                pause = min(pause, 1.0)
            self._not_before = time.monotonic() + pause
            log.error("gcs upload failed; will retry", job=self.tier.job, step=step_dir.name, error=str(error),
                      failures=self._failures, retry_in_s=pause)
            return True


def ensure_newest_local(tier: GcsTier, local_job_dir: Path) -> Path | None:
    """Before a worker starts: if the newest complete remote step is newer than the newest
    valid local one (a fresh or replaced host), download it. Returns the newest valid local
    step directory afterwards (None: nothing to resume from). Raises tpud.gcs.tier.RemoteError when
    the remote cannot be read or the download fails: starting the worker anyway would redo
    steps already committed remotely, so the caller should back off and try again."""
    local_job_dir = Path(local_job_dir)
    local = newest_valid_local(local_job_dir)
    local_key = (local[1].step, local[1].micro_step) if local else None
    committed = tier.committed_steps()
    damaged = [s.name for s in committed if not s.complete and (local_key is None or s.key > local_key)]
    if damaged:
        log.warning("gcs resume: remote steps damaged (objects missing or not matching their manifest), skipped",
                    job=tier.job, steps=damaged)
    complete = [s for s in committed if s.complete]
    remote = complete[-1] if complete else None
    if remote is None or (local_key is not None and remote.key <= local_key):
        log.info("gcs resume: local is newest", job=tier.job, local=local[0].name if local else None,
                 remote=remote.name if remote else None)
        return local[0] if local else None
    log.info("gcs resume: downloading the newest step", job=tier.job, local=local[0].name if local else None,
             remote=remote.name)
    return tier.download_step(remote.step, local_job_dir, remote.micro_step)
