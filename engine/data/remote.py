"""Datasets and inputs on Google Cloud Storage: listing, streaming reads, upload and a verified cache.

Torch-free: the daemon uses `fetch` to bring a job's gs:// dataset to the host before its
worker starts, and a worker run without the daemon calls the same function. The emulator
named by STORAGE_EMULATOR_HOST is used when set (anonymous credentials), as in the GCS tier.

An upload sends every data file, checks each object's CRC32C against the manifest, and
sends manifest.json last: a remote dataset with a manifest is complete. A download goes to
a temporary directory, checks every file against the manifest, writes the manifest last and
renames the directory into the cache, so a cached dataset is complete or absent; jobs on the
host share it (one directory per dataset identity, under a lock).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import structlog

from engine.checkpoint.manifest import file_crc32c
from engine.data import manifest as mf
from engine.layout import atomic_write, fsync_path

log = structlog.get_logger()

_URL = re.compile(r"^gs://(?P<bucket>[a-z0-9][a-z0-9._-]{1,220}[a-z0-9])(/(?P<prefix>.*))?$")


class RemoteDataError(OSError):
    """A gs:// dataset that cannot be read or does not match its manifest."""


def split(url: str) -> tuple[str, str]:
    match = _URL.match(url)
    if not match:
        raise ValueError(f"not a gs://bucket[/path] URL: {url!r}")
    return match["bucket"], match["prefix"] or ""


_clients: dict[str | None, object] = {}


def client():
    """One client per process and endpoint (tests point STORAGE_EMULATOR_HOST at several servers)."""
    endpoint = os.environ.get("STORAGE_EMULATOR_HOST")
    if endpoint not in _clients:
        from google.cloud import storage

        _clients[endpoint] = storage.Client()
    return _clients[endpoint]


def list_objects(bucket: str, prefix: str) -> Iterator[tuple[str, int, float]]:
    for blob in client().list_blobs(bucket, prefix=prefix):
        yield blob.name, blob.size, blob.updated.timestamp() if blob.updated else 0.0


def open_blob(url: str) -> BinaryIO:
    bucket, name = split(url)
    return client().bucket(bucket).blob(name).open("rb", chunk_size=8 << 20)


def read_manifest(url: str) -> mf.Manifest | None:
    """The manifest of a gs:// dataset, None when there is none (not prepared, or not finished)."""
    from google.api_core import exceptions

    bucket, prefix = split(url)
    try:
        text = client().bucket(bucket).blob(join(prefix, mf.MANIFEST)).download_as_text()
    except exceptions.NotFound:
        return None
    return mf.parse(text, join(url, mf.MANIFEST))


def join(prefix: str, name: str) -> str:
    return f"{prefix.rstrip('/')}/{name}" if prefix else name


def upload(local: Path, url: str, manifest: mf.Manifest) -> None:
    """The dataset in `local` to `url`: data files (checked), then the manifest."""
    from google.cloud.storage import transfer_manager

    bucket_name, prefix = split(url)
    bucket = client().bucket(bucket_name)
    names = [entry.path for entry in manifest.files]
    results = transfer_manager.upload_many_from_filenames(
        bucket, names, source_directory=str(local), blob_name_prefix=join(prefix, ""), worker_type="thread",
        max_workers=8, raise_exception=True)
    del results
    for entry in manifest.files:
        blob = bucket.get_blob(join(prefix, entry.path))
        if blob is None or blob.crc32c != entry.crc32c or blob.size != entry.bytes:
            raise RemoteDataError(f"{url}/{entry.path}: uploaded object does not match the local file")
    bucket.blob(join(prefix, mf.MANIFEST)).upload_from_string(manifest.to_json(), content_type="application/json")


def cache_dir(cache_root: Path, url: str, manifest: mf.Manifest) -> Path:
    key = hashlib.sha256(f"{url}\n{manifest.identity}".encode()).hexdigest()[:20]
    return Path(cache_root) / key


def fetch(url: str, cache_root: Path) -> Path:
    """A verified local copy of the gs:// dataset at `url`, downloaded once per host and shared."""
    manifest = read_manifest(url)
    if manifest is None:
        raise RemoteDataError(f"{url}: not a prepared dataset: no {mf.MANIFEST} (an unfinished `tpud prepare`?)")
    target = cache_dir(cache_root, url, manifest)
    if (target / mf.MANIFEST).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another job on this host may be fetching it
        if not (target / mf.MANIFEST).is_file():
            _download(url, manifest, target)
    return target


def _download(url: str, manifest: mf.Manifest, target: Path) -> None:
    from google.cloud.storage import transfer_manager

    bucket_name, prefix = split(url)
    bucket = client().bucket(bucket_name)
    log.info("downloading dataset", url=url, files=len(manifest.files),
             mb=round(sum(e.bytes for e in manifest.files) / 1e6, 1), to=str(target))
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        names = [entry.path for entry in manifest.files]
        transfer_manager.download_many_to_path(bucket, names, destination_directory=str(staging),
                                               blob_name_prefix=join(prefix, ""), worker_type="thread",
                                               max_workers=8, raise_exception=True)
        for entry in manifest.files:
            path = staging / entry.path
            if path.stat().st_size != entry.bytes or file_crc32c(path) != entry.crc32c:
                raise RemoteDataError(f"{url}/{entry.path}: downloaded bytes do not match the manifest's CRC32C")
            fsync_path(path)
        atomic_write(staging / mf.MANIFEST, manifest.to_json())
        staging.rename(target)
        fsync_path(target.parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
