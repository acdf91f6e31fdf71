"""A Hugging Face model directory on gs://: config.json read in place, the rest cached on the host.

Torch-free: the spec loader reads config.json (to fill in the model section) and the daemon
fetches the model before a worker starts; a worker run without the daemon fetches it itself.
Only the files a model load needs are taken from the directory's top level (config, weights,
index, tokenizer): published repositories also hold other copies of the weights (`original/`).

The cache is `<state>/models/<key>/`, one directory per URL and listing (names, sizes,
CRC32C), so a changed model is fetched again. A download goes to a staging directory, every
file's CRC32C is checked against the object's, and the directory is renamed into place: a
cached model is complete or absent. Jobs on the host share it under a lock.
"""

from __future__ import annotations

import fcntl
import hashlib
import re
import shutil
import tempfile
from pathlib import Path

import structlog

from engine.checkpoint.manifest import file_crc32c
from engine.data.remote import RemoteDataError, client, join, split
from engine.layout import fsync_path

log = structlog.get_logger()

_TOKENIZER_FILES = r"tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json|tokenizer\.model|chat_template\.jinja"
WANTED = re.compile(r"^(config\.json|generation_config\.json|model\.safetensors\.index\.json|[^/]+\.safetensors|"
                    rf"{_TOKENIZER_FILES})$")
TOKENIZER = re.compile(rf"^({_TOKENIZER_FILES})$")


def read_config(url: str, limit: int) -> bytes:
    """config.json of the gs:// model directory `url`; FileNotFoundError when it has none."""
    from google.api_core import exceptions

    bucket, prefix = split(url)
    blob = client().bucket(bucket).get_blob(join(prefix, "config.json"), timeout=30)
    if blob is None:
        raise FileNotFoundError(f"{url}/config.json")
    if blob.size is not None and blob.size > limit:
        raise ValueError(f"{url}/config.json: {blob.size} bytes, more than {limit}")
    try:
        return blob.download_as_bytes(timeout=30)
    except exceptions.GoogleAPICallError as e:
        raise OSError(f"{url}/config.json: {e}") from None


def _listing(url: str, wanted: re.Pattern) -> list:
    bucket, prefix = split(url)
    blobs = client().list_blobs(bucket, prefix=join(prefix, ""), delimiter="/", timeout=60)
    return sorted((b for b in blobs if wanted.match(b.name.rsplit("/", 1)[-1])), key=lambda b: b.name)


def _download(blobs: list, into: Path, url: str) -> None:
    for blob in blobs:
        path = into / blob.name.rsplit("/", 1)[-1]
        blob.download_to_filename(str(path), timeout=600)
        if path.stat().st_size != blob.size or (blob.crc32c and file_crc32c(path) != blob.crc32c):
            raise RemoteDataError(f"{url}/{path.name}: downloaded bytes do not match the object's CRC32C")
        fsync_path(path)


def fetch(url: str, cache_root: Path) -> Path:
    """A verified local copy of the gs:// model directory `url`, downloaded once per host and shared."""
    blobs = _listing(url, WANTED)
    if not any(b.name.endswith("/config.json") or b.name == "config.json" for b in blobs):
        raise RemoteDataError(f"{url}: no config.json (expected a Hugging Face model directory)")
    listing = "\n".join(f"{b.name} {b.size} {b.crc32c}" for b in blobs)
    target = Path(cache_root) / hashlib.sha256(f"{url}\n{listing}".encode()).hexdigest()[:20]
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another job on this host may be fetching it
        if not target.is_dir():
            log.info("downloading model", url=url, files=len(blobs), mb=round(sum(b.size for b in blobs) / 1e6, 1),
                     to=str(target))
            staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
            try:
                _download(blobs, staging, url)
                staging.rename(target)
                fsync_path(target.parent)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return target


def fetch_tokenizer(url: str, into: Path) -> list[Path]:
    """Only the tokenizer files of the gs:// model directory `url`, into `into`."""
    blobs = _listing(url, TOKENIZER)
    _download(blobs, into, url)
    return [into / b.name.rsplit("/", 1)[-1] for b in blobs]
