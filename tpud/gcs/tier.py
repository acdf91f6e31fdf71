"""One job's Google Cloud Storage tier (torch-free; runs in the supervisor).

    gs://bucket/prefix/<job>/step_000000123/        the local step directory's files, same
    gs://bucket/prefix/<job>/step_000000123.0002/   relative paths, + manifest.json uploaded LAST
                                                    = commit marker (.0002: a partial step)

A remote step is named like its local directory (engine.checkpoint.manifest.step_dir_name)
and ordered by (step, micro_step), as committed_steps orders local ones.

Writes are create-only (if_generation_match=0): a committed object is never overwritten.
An upload that finds an object already there (HTTP 412, e.g. a retry whose first attempt
reached the server, or a second upload of the same step) compares the object's CRC32C with
the manifest's: equal is done, different is a RemoteConflict. Every object is checked
against the manifest's size and CRC32C after it lands; the manifest goes up only when all
data objects are verified, so a remote step with a manifest is complete.

Downloads go to a temporary directory beside the target, are checked file by file against
the remote manifest, get the manifest written last (engine.checkpoint.manifest.write_manifest)
and are renamed into place, so a local step directory is either committed or absent.

Transient errors (connection errors, timeouts, 408, 429, 5xx) are retried with exponential
backoff, for at most RetryPolicy.deadline seconds per operation; the parallel transfers use
google.cloud.storage.transfer_manager with threads (the supervisor must not fork).
"""

from __future__ import annotations

import random
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TypeVar

import structlog
from google.api_core import exceptions as api_exceptions
from google.api_core import retry as api_retry
from google.cloud import storage
from google.cloud.storage import retry as storage_retry
from google.cloud.storage import transfer_manager
from google.cloud.storage.exceptions import DataCorruption

from engine.checkpoint.manifest import (
    GLOBAL,
    MANIFEST,
    Manifest,
    committed_steps,
    file_crc32c,
    problems,
    read_manifest,
    step_dir_name,
    write_global,
    write_manifest,
)
from engine.layout import fsync_path

log = structlog.get_logger()

_REMOTE = re.compile(r"^gs://(?P<bucket>[a-z0-9][a-z0-9._-]{1,220}[a-z0-9])(?:/(?P<prefix>.*))?$")
_STEP_DIR = re.compile(r"^step_(\d{9})(?:\.(\d{4}))?$")  # as engine.checkpoint.manifest
_T = TypeVar("_T")


class RemoteError(Exception):
    """The GCS tier failed; the message says what and where."""


class RemoteUnavailable(RemoteError):
    """Transient errors (connection, timeout, 429, 5xx) outlasted RetryPolicy.deadline."""


class RemoteConflict(RemoteError):
    """An object already exists with other contents; it is never overwritten."""


class RemoteCorrupt(RemoteError):
    """Data does not match the manifest's size or CRC32C."""


def parse_remote(url: str) -> tuple[str, str]:
    """gs://bucket/a/b/ -> ("bucket", "a/b")."""
    match = _REMOTE.match(url)
    if not match:
        raise ValueError(f"not a gs://bucket[/prefix] URL: {url!r}")
    return match["bucket"], (match["prefix"] or "").strip("/")


def is_transient(exc: BaseException) -> bool:
    return isinstance(exc, api_exceptions.RetryError) or storage_retry._should_retry(exc)


def make_client() -> storage.Client:
    """A client for the real GCS (application default credentials), or for the emulator
    named by STORAGE_EMULATOR_HOST (anonymous credentials)."""
    try:
        return storage.Client()
    except Exception as e:  # google.auth.exceptions.DefaultCredentialsError and friends
        raise RemoteError(f"cannot create a GCS client: {e}") from e


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff for transient errors, bounded per operation by `deadline` seconds."""

    initial: float = 1.0
    maximum: float = 32.0
    multiplier: float = 2.0
    deadline: float = 300.0
    request_timeout: float = 60.0  # one HTTP request

    def api(self, until: float) -> api_retry.Retry:
        """google.api_core's Retry for one client call, ending at monotonic time `until`."""
        return api_retry.Retry(predicate=storage_retry._should_retry, initial=self.initial,
                               maximum=self.maximum, multiplier=self.multiplier,
                               timeout=max(0.1, until - time.monotonic()), on_error=_retrying)

    def backoff(self, attempt: int) -> float:
        return min(self.maximum, self.initial * self.multiplier ** attempt) * random.uniform(0.5, 1.0)


@dataclass(frozen=True)
class Transfer:
    """What one upload or download moved."""

    name: str              # step directory name, step_000000123[.0002]
    files: int
    bytes: int             # transferred
    skipped_bytes: int     # already in place (same CRC32C), not transferred again
    seconds: float

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class RemoteStep:
    """A committed remote step: its manifest.json exists and parses."""

    name: str                   # step_000000123[.0002], as the local directory
    url: str
    manifest: Manifest
    committed: datetime | None  # when manifest.json was created remotely
    problems: tuple[str, ...] = field(default=())  # data objects missing or not matching the manifest

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def micro_step(self) -> int:
        return self.manifest.micro_step

    @property
    def key(self) -> tuple[int, int]:
        return self.manifest.step, self.manifest.micro_step

    @property
    def complete(self) -> bool:
        return not self.problems


class GcsTier:
    """The remote tier of one job: gs://bucket/prefix/<job>/step_N/."""

    def __init__(self, remote: str, job: str, *, client: storage.Client | None = None, workers: int = 8,
                 retry: RetryPolicy = RetryPolicy()):
        self.bucket_name, prefix = parse_remote(remote)
        self.job = job
        self.prefix = f"{prefix}/{job}/" if prefix else f"{job}/"
        self.url = f"gs://{self.bucket_name}/{self.prefix}"
        self.workers = workers
        self.retry = retry
        self._client = client

    @classmethod
    def for_spec(cls, spec, **kwargs) -> GcsTier | None:
        """The tier of a JobSpec, or None when checkpoint.remote is not set."""
        remote = spec.checkpoint.remote
        return cls(remote, spec.name, **kwargs) if remote else None

    @property
    def client(self) -> storage.Client:
        if self._client is None:
            self._client = make_client()
        return self._client

    @property
    def bucket(self) -> storage.Bucket:
        return self.client.bucket(self.bucket_name)

    def step_prefix(self, name: str) -> str:
        """Object name prefix of a step directory name (step_dir_name(step, micro_step))."""
        return f"{self.prefix}{name}/"

    # -- small helpers --------------------------------------------------------------------

    def _deadline(self) -> float:
        return time.monotonic() + self.retry.deadline

    def _call(self, what: str, until: float, fn: Callable[..., _T], *args, **kwargs) -> _T:
        """One client call with the retry policy; errors become RemoteError naming `what`."""
        try:
            return fn(*args, retry=self.retry.api(until), timeout=self.retry.request_timeout, **kwargs)
        except RemoteError:
            raise
        except Exception as e:
            if is_transient(e):
                raise RemoteUnavailable(f"{what}: still failing after {self.retry.deadline:g}s of retries: "
                                        f"{_cause(e)}") from e
            raise RemoteError(f"{what}: {e}") from e

    def _list(self, prefix: str, until: float) -> dict[str, storage.Blob]:
        def listing(retry, timeout):
            return {b.name: b for b in self.client.list_blobs(self.bucket_name, prefix=prefix,
                                                                retry=retry, timeout=timeout)}
        return self._call(f"listing gs://{self.bucket_name}/{prefix}", until, listing)

    def _listing(self, until: float) -> dict[str, dict[str, storage.Blob]]:
        """Objects under the job's prefix: step dir name -> {path relative to it: blob}, oldest first."""
        steps: dict[str, dict[str, storage.Blob]] = {}
        for name, blob in self._list(self.prefix, until).items():
            head, _, rel = name[len(self.prefix):].partition("/")
            if _STEP_DIR.match(head) and rel:
                steps.setdefault(head, {})[rel] = blob
        return dict(sorted(steps.items(), key=lambda item: _key(item[0])))

    def _read_remote_manifest(self, blob: storage.Blob, until: float) -> Manifest | None:
        """The parsed manifest, or None when it is gone or does not parse."""
        try:
            text = self._call(f"reading gs://{self.bucket_name}/{blob.name}", until, blob.download_as_bytes)
        except RemoteError as e:
            if isinstance(e.__cause__, api_exceptions.NotFound):
                return None
            raise
        try:
            return Manifest.from_json(text.decode())
        except (ValueError, TypeError, KeyError) as e:
            log.warning("gcs manifest does not parse", object=f"gs://{self.bucket_name}/{blob.name}", error=str(e))
            return None

    # -- listing --------------------------------------------------------------------------

    def committed_steps(self) -> list[RemoteStep]:
        """Remote steps whose manifest.json exists and parses, oldest first; `problems` lists
        data objects missing or not matching the manifest (size, CRC32C from the listing)."""
        until = self._deadline()
        return self._committed(self._listing(until), until)

    def _committed(self, listing: dict[str, dict[str, storage.Blob]], until: float) -> list[RemoteStep]:
        found = []
        for name, objects in listing.items():
            if (blob := objects.get(MANIFEST)) is None:
                continue
            manifest = self._read_remote_manifest(blob, until)
            if manifest is None or step_dir_name(manifest.step, manifest.micro_step) != name:
                continue
            if manifest.hosts > 1 and GLOBAL not in objects:  # a multi-host step commits with its marker
                continue
            issues = []
            for entry in manifest.files:
                obj = objects.get(entry.path)
                if obj is None:
                    issues.append(f"{entry.path}: missing")
                elif obj.size != entry.size or obj.crc32c != entry.crc32c:
                    issues.append(f"{entry.path}: {obj.size} bytes CRC32C {obj.crc32c}, manifest says "
                                  f"{entry.size} bytes CRC32C {entry.crc32c}")
            found.append(RemoteStep(name, f"gs://{self.bucket_name}/{self.step_prefix(name)}", manifest,
                                    blob.time_created, tuple(issues)))
        return found

    # -- upload ---------------------------------------------------------------------------

    def _pause_before_retry(self, verb: str, name: str, where: str, failing: int, error: Exception, attempt: int,
                            until: float) -> None:
        """Give up once the retry deadline has passed; otherwise log and sleep the backoff."""
        if time.monotonic() >= until:
            raise RemoteUnavailable(f"{verb}ing {where}: {failing} files still failing after "
                                    f"{self.retry.deadline:g}s of retries: {_cause(error)}")
        pause = self.retry.backoff(attempt)
        log.warning(f"gcs {verb} retrying", job=self.job, step=name, files=failing, error=_cause(error),
                    retry_in_s=round(pause, 2))
        time.sleep(min(pause, max(0.0, until - time.monotonic())))

    def _in_rounds(self, verb: str, name: str, where: str, pending: dict, send: Callable[[list[str]], list],
                   settle: Callable[[str, object, object], BaseException | None], until: float) -> None:
        """Transfer `pending` (path -> manifest entry) in rounds, until none is left: `send(paths)` is one
        parallel transfer_manager call, a result per path; `settle(path, entry, result)` checks one,
        raising where it must stop, and returns the error of a transient failure (tried again next
        round, after the backoff) or None once the path is done. Past the deadline: RemoteUnavailable."""
        attempt = 0
        while pending:
            paths, transient = list(pending), []
            for path, result in zip(paths, send(paths)):
                if (error := settle(path, pending[path], result)) is None:
                    del pending[path]
                else:
                    transient.append(error)
            if pending:
                self._pause_before_retry(verb, name, where, len(pending), transient[0], attempt, until)
                attempt += 1

    def upload_step(self, local_step_dir: Path) -> Transfer:
        """Upload a committed local step directory: data objects in parallel, create-only,
        each verified against the manifest, then manifest.json (create-only) last."""
        local_step_dir = Path(local_step_dir)
        manifest = read_manifest(local_step_dir)
        if manifest is None:
            raise RemoteError(f"{local_step_dir}: not a committed step directory (no valid {MANIFEST})")
        if issues := problems(local_step_dir, manifest, checksums=False):
            raise RemoteError(f"{local_step_dir}: damaged, not uploading: {'; '.join(issues)}")
        name = step_dir_name(manifest.step, manifest.micro_step)
        if local_step_dir.name != name:
            raise RemoteError(f"{local_step_dir}: its manifest is of {name}")
        prefix = self.step_prefix(name)
        where = f"gs://{self.bucket_name}/{prefix}"
        start, until = time.monotonic(), self._deadline()
        existing = self._list(prefix, until)
        remote_manifest = existing.get(MANIFEST)
        if remote_manifest is not None:
            self._accept_existing_manifest(remote_manifest, manifest, where, until)
            log.info("gcs step already committed", job=self.job, step=name, url=where)
            return Transfer(name, 0, 0, manifest.total_bytes, time.monotonic() - start)

        pending = {}
        skipped = 0
        for entry in manifest.files:
            obj = existing.get(prefix + entry.path)
            if obj is None:
                pending[entry.path] = entry
            elif obj.size == entry.size and obj.crc32c == entry.crc32c:
                skipped += entry.size  # an earlier, interrupted upload of this step got it there
            else:
                raise self._conflict(where + entry.path, obj, entry)
        total = sum(e.size for e in pending.values())
        log.info("gcs upload started", job=self.job, step=name, url=where, files=len(pending), bytes=total,
                 already_there=len(manifest.files) - len(pending))
        found_there = self._upload_data(local_step_dir, name, prefix, pending, until)
        skipped += found_there
        total -= found_there
        self._commit_manifest(local_step_dir, manifest, prefix, where, until)
        transfer = Transfer(name, len(manifest.files), total, skipped, time.monotonic() - start)
        log.info("gcs upload committed", job=self.job, step=name, url=where, files=transfer.files,
                 bytes=transfer.bytes, skipped_bytes=transfer.skipped_bytes, seconds=round(transfer.seconds, 3),
                 mb_per_s=round(transfer.mb_per_s, 1))
        return transfer

    def _upload_data(self, local_step_dir: Path, name: str, prefix: str, pending: dict, until: float) -> int:
        """The step's data objects, create-only, each verified; the bytes found already there (an
        earlier attempt's, or another writer's of the same bytes)."""
        where, found_there = f"gs://{self.bucket_name}/{prefix}", 0
        blobs: dict[str, storage.Blob] = {}  # this round's: an upload leaves its size and CRC32C on its blob

        def send(paths: list[str]) -> list:
            blobs.update((path, self.bucket.blob(prefix + path)) for path in paths)
            return transfer_manager.upload_many(
                [(str(local_step_dir / path), blobs[path]) for path in paths], upload_kwargs=dict(
                    if_generation_match=0, checksum="crc32c", content_type="application/octet-stream",
                    retry=self.retry.api(until), timeout=self.retry.request_timeout),
                worker_type=transfer_manager.THREAD, max_workers=self.workers, raise_exception=False)

        def settle(path: str, entry, result) -> BaseException | None:
            nonlocal found_there
            if isinstance(result, api_exceptions.PreconditionFailed):
                # Already there: our own earlier attempt, or another writer. Same bytes or bust.
                try:
                    obj = self._call(f"checking {where}{path}", until, self.bucket.get_blob, prefix + path)
                except RemoteUnavailable as e:
                    return e
                if obj is None:
                    return result  # deleted meanwhile: upload again
                if obj.size != entry.size or obj.crc32c != entry.crc32c:
                    raise self._conflict(where + path, obj, entry)
                found_there += entry.size
            elif isinstance(result, BaseException):
                if is_transient(result) or _upload_session_lost(result):
                    return result  # a lost resumable session: the next round starts anew
                raise RemoteError(f"uploading {where}{path}: {result}") from result
            else:
                self._verify_uploaded(blobs[path], entry, where + path, until)
            return None

        self._in_rounds("upload", name, where, pending, send, settle, until)
        return found_there

    def _commit_manifest(self, local_step_dir: Path, manifest: Manifest, prefix: str, where: str,
                         until: float) -> None:
        """Every data object is there and verified: now the commit marker (and a gang's global one)."""
        manifest_blob = self.bucket.blob(prefix + MANIFEST)
        if self._create(manifest_blob, local_step_dir / MANIFEST, where, until):
            if manifest_blob.crc32c != file_crc32c(local_step_dir / MANIFEST):
                raise RemoteCorrupt(f"{where}{MANIFEST}: CRC32C {manifest_blob.crc32c} does not match the local file")
        else:
            existing_blob = self._call(f"checking {where}{MANIFEST}", until, self.bucket.get_blob,
                                       prefix + MANIFEST)
            if existing_blob is None:
                raise RemoteError(f"{where}{MANIFEST}: precondition failed but the object is gone")
            self._accept_existing_manifest(existing_blob, manifest, where, until)
        if manifest.hosts > 1:  # a multi-host step: its global marker, last (there already: committed either way)
            self._create(self.bucket.blob(prefix + GLOBAL), local_step_dir / GLOBAL, where, until)

    def _create(self, blob: storage.Blob, local: Path, where: str, until: float) -> bool:
        """Upload a small JSON file create-only: False when the object already exists."""
        try:
            self._call(f"uploading {where}{local.name}", until, blob.upload_from_filename, str(local),
                       if_generation_match=0, checksum="crc32c", content_type="application/json")
        except RemoteError as e:
            if not isinstance(e.__cause__, api_exceptions.PreconditionFailed):
                raise
            return False
        return True

    def _conflict(self, url: str, obj: storage.Blob, entry) -> RemoteConflict:
        return RemoteConflict(
            f"{url} already exists with {obj.size} bytes, CRC32C {obj.crc32c}, but the local manifest says "
            f"{entry.size} bytes, CRC32C {entry.crc32c}: another writer uploaded a different step "
            f"{self.job}/{url.rsplit('/', 2)[-2]}; not overwriting it")

    def _verify_uploaded(self, blob: storage.Blob, entry, url: str, until: float) -> None:
        if blob.crc32c is None or blob.size is None:
            blob = self._call(f"checking {url}", until, self.bucket.get_blob, blob.name) or blob
        if blob.size == entry.size and blob.crc32c == entry.crc32c:
            return
        # We created this object and it is wrong (the local file changed since its commit,
        # or bytes were damaged on the way): take it back, so a later attempt can retry.
        try:
            self._call(f"deleting {url}", until, blob.delete, if_generation_match=blob.generation)
        except RemoteError as e:
            log.warning("gcs could not delete a corrupt upload", url=url, error=str(e))
        raise RemoteCorrupt(f"{url}: uploaded {blob.size} bytes with CRC32C {blob.crc32c}, the manifest says "
                            f"{entry.size} bytes with CRC32C {entry.crc32c}")

    def _accept_existing_manifest(self, blob: storage.Blob, manifest: Manifest, where: str, until: float) -> None:
        remote = self._read_remote_manifest(blob, until)
        if remote is None or (remote.step, remote.micro_step) != (manifest.step, manifest.micro_step) \
                or remote.files != manifest.files:
            raise RemoteConflict(f"{where}{MANIFEST} already exists and describes other files than the local "
                                 "step: another writer committed a different one; not overwriting it")

    # -- download -------------------------------------------------------------------------

    def download_step(self, step: int, local_job_dir: Path, micro_step: int = 0) -> Path:
        """Download committed remote step (step, micro_step) into local_job_dir/step_dir_name(...)
        (local_job_dir is <checkpoint root>/<job>): parallel, each file checked against the
        remote manifest's size and CRC32C, manifest written last, then an atomic rename.
        Returns the local step directory."""
        local_job_dir = Path(local_job_dir)
        start, until = time.monotonic(), self._deadline()
        name = step_dir_name(step, micro_step)
        prefix = self.step_prefix(name)
        where = f"gs://{self.bucket_name}/{prefix}"
        manifest = self._read_remote_manifest(self.bucket.blob(prefix + MANIFEST), until)
        if manifest is None or (manifest.step, manifest.micro_step) != (step, micro_step):
            raise RemoteError(f"{where}: not committed remotely (no valid {MANIFEST})")
        target = local_job_dir / name
        if (local := read_manifest(target)) is not None and local.files == manifest.files \
                and not problems(target, local, checksums=False):
            log.info("gcs step already local", job=self.job, step=name, path=str(target))
            return target
        local_job_dir.mkdir(parents=True, exist_ok=True)
        # ".tmp-step_*": what the engine's checkpointer removes as unfinished after a crash.
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}.download-", dir=local_job_dir))
        log.info("gcs download started", job=self.job, step=name, url=where, files=len(manifest.files),
                 bytes=manifest.total_bytes)
        try:
            self._download_data(manifest, name, prefix, tmp, target, until)
            write_manifest(tmp, manifest)  # fsyncs the data files, then the manifest, last
            if manifest.hosts > 1:  # committed remotely, so globally: this host's copy is marked too
                write_global(tmp, manifest)
            if target.exists():  # an uncommitted or damaged leftover: out of the way first
                aside = Path(tempfile.mkdtemp(prefix=f".tmp-{name}.replaced-", dir=local_job_dir))
                target.rename(aside / target.name)
                shutil.rmtree(aside, ignore_errors=True)
            tmp.rename(target)
            fsync_path(local_job_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        seconds = time.monotonic() - start
        transfer = Transfer(name, len(manifest.files), manifest.total_bytes, 0, seconds)
        log.info("gcs download committed", job=self.job, step=name, path=str(target), files=transfer.files,
                 bytes=transfer.bytes, seconds=round(seconds, 3), mb_per_s=round(transfer.mb_per_s, 1))
        return target

    def _download_data(self, manifest: Manifest, name: str, prefix: str, into: Path, target: Path,
                       until: float) -> None:
        """The step's data objects into `into` (renamed to `target` once all are there), each checked
        against the manifest's size and CRC32C."""
        where = f"gs://{self.bucket_name}/{prefix}"
        pending = {entry.path: entry for entry in manifest.files}
        for path in pending:
            (into / path).parent.mkdir(parents=True, exist_ok=True)

        def send(paths: list[str]) -> list:
            return transfer_manager.download_many(
                [(self.bucket.blob(prefix + path), str(into / path)) for path in paths],
                download_kwargs=dict(checksum="crc32c", retry=self.retry.api(until), timeout=self.retry.request_timeout),
                worker_type=transfer_manager.THREAD, max_workers=self.workers, raise_exception=False)

        def settle(path: str, entry, result) -> BaseException | None:
            if isinstance(result, BaseException):
                if is_transient(result):
                    return result
                if isinstance(result, api_exceptions.NotFound):
                    raise RemoteCorrupt(f"{where}{path}: listed in the manifest but missing") from result
                if isinstance(result, DataCorruption):
                    raise RemoteCorrupt(f"{where}{path}: damaged in transit: {result}") from result
                raise RemoteError(f"downloading {where}{path}: {result}") from result
            size, crc = (into / path).stat().st_size, file_crc32c(into / path)
            if size != entry.size or crc != entry.crc32c:
                raise RemoteCorrupt(f"{where}{path}: {size} bytes with CRC32C {crc}, the manifest says "
                                    f"{entry.size} bytes with CRC32C {entry.crc32c}; not committing {target}")
            return None

        self._in_rounds("download", name, where, pending, send, settle, until)

    # -- retention ------------------------------------------------------------------------

    def apply_retention(self, keep: int) -> list[str]:
        """Keep the newest `keep` committed remote steps (never fewer than one: the newest is
        never deleted); delete older committed steps, manifest first so a half-deleted step is
        never committed, and leftovers of uncommitted uploads older than the oldest kept step.
        Returns the step directory names deleted, oldest first."""
        until = self._deadline()
        listing = self._listing(until)
        committed = [s.name for s in self._committed(listing, until)]
        kept = committed[-max(1, keep):]
        if not kept:
            return []
        doomed = [name for name in listing if _key(name) < _key(kept[0])]
        for name in doomed:
            objects = listing[name]
            data = [b.name for rel, b in objects.items() if rel not in (MANIFEST, GLOBAL)]
            for marker in (GLOBAL, MANIFEST):  # the commit markers first: a half-deleted step is never committed
                if marker in objects:
                    self._delete([objects[marker].name], until)
            self._delete(data, until)
            log.info("gcs step deleted", job=self.job, step=name, objects=len(objects),
                     committed=name in committed)
        return doomed

    def _delete(self, names: Iterable[str], until: float) -> None:
        def one(name: str) -> None:
            try:
                self._call(f"deleting gs://{self.bucket_name}/{name}", until, self.bucket.blob(name).delete)
            except RemoteError as e:
                if not isinstance(e.__cause__, api_exceptions.NotFound):
                    raise
        names = list(names)
        if len(names) == 1:
            one(names[0])
        elif names:
            with ThreadPoolExecutor(max_workers=self.workers) as pool:
                list(pool.map(one, names))


def newest_valid_local(local_job_dir: Path) -> tuple[Path, Manifest] | None:
    """The newest local step with a manifest and every file present with its size."""
    for _, directory, manifest in reversed(committed_steps(Path(local_job_dir))):
        if not problems(directory, manifest, checksums=False):
            return directory, manifest
    return None


def _key(name: str) -> tuple[int, int]:
    """step_000000123.0002 -> (123, 2): the order of steps."""
    match = _STEP_DIR.match(name)
    return int(match[1]), int(match[2] or 0)


def _upload_session_lost(exc: BaseException) -> bool:
    """404/410 on a resumable upload's session URL: the session expired or the server forgot it
    (a restarted fake-gcs-server). The file can be uploaded again with a new session."""
    response = getattr(exc, "response", None)
    request = getattr(response, "request", None)
    return getattr(exc, "code", None) in (404, 410) and "upload_id=" in str(getattr(request, "url", ""))


def _retrying(exc: BaseException) -> None:
    log.warning("gcs request failed, retrying", error=_cause(exc))


def _cause(exc: BaseException) -> str:
    """The innermost cause of a (retry-wrapped) error, short."""
    while isinstance(exc, api_exceptions.RetryError) and exc.cause is not None:
        exc = exc.cause
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text[:300]}"
