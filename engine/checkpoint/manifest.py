"""The checkpoint layout and its commit marker, manifest.json (torch-free).

    <root>/<job>/step_000000123/        DCP files + manifest.json, written last
    <root>/<job>/step_000000123.0002/   partial step: 2 micro-batches of step 124 accumulated
    <root>/<job>/step_000000123/global.json   a job on several hosts: every host's part is durable

A step directory without a valid manifest does not exist: writers fill a temporary
directory, write the manifest last, and rename the directory into place. Readers trust a
directory only when the manifest parses and every file it lists is present with its
size and (when asked) its CRC32C.

A job on several hosts: each host writes its own part of a step (its manifest says `hosts`),
and once every host's part is committed each host writes `global.json` into its part, last.
Until then the part is not a committed step for anyone (`committed_steps`); only restore's
agreement between hosts looks at bare parts (`parts`), to take the newest step that every
host can reach. The supervisor reads this module too, for the GCS
tier, so it must not import torch.

CRC32C values are base64 of the big-endian 4-byte checksum, the form GCS reports for an
object, so a local file and its uploaded copy compare directly.
"""

from __future__ import annotations

import base64
import json
import math
import mmap
import os
import re
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import crc32c as crc32c_package
import google_crc32c

from engine.layout import atomic_write, fsync_path

MANIFEST = "manifest.json"
FORMAT = 1
_STEP_DIR = re.compile(r"^step_(\d{9})(?:\.(\d{4}))?$")
_READ_BLOCK = 8 << 20


def step_dir_name(step: int, micro_step: int = 0) -> str:
    return f"step_{step:09d}" + (f".{micro_step:04d}" if micro_step else "")


def crc32c(data: bytes | mmap.mmap) -> str:
    """The CRC32C of bytes already in memory (or mapped), in the manifest's form. The crc32c
    package reads any buffer in place and lets other threads run meanwhile; google-crc32c's
    extension takes bytes only, a copy, and holds the GIL (the training thread waits on it)."""
    with memoryview(data) as view:
        return base64.b64encode(crc32c_package.crc32c(view).to_bytes(4, "big")).decode()


def file_crc32c(path: Path) -> str:
    checksum = google_crc32c.Checksum()
    with open(path, "rb") as f:
        while block := f.read(_READ_BLOCK):
            checksum.update(block)
    return base64.b64encode(checksum.digest()).decode()


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the step directory
    size: int
    crc32c: str


@dataclass(frozen=True)
class Manifest:
    job: str
    step: int          # optimizer steps completed
    micro_step: int    # micro-batches of the next step already accumulated (partial-step checkpoint)
    world_size: int
    spec_hash: str
    version: str
    reason: str        # interval, request, final, preemption, ...
    files: tuple[FileEntry, ...]
    created_unix: float = field(default_factory=time.time)
    format: int = FORMAT
    # Optional fields, added later: manifests without them still read, with these defaults.
    wandb_run_id: str | None = None  # the supervisor's wandb run, so a resume on another host continues it
    data_skips: tuple[tuple[int, int], ...] = ()  # the loader's skipped micro-batch ranges (rollbacks)
    host: int = 0   # which host wrote this part, of `hosts`: more than one needs global.json to commit
    hosts: int = 1
    members: tuple[int, ...] = ()  # the gang's hosts, by host number (a gang may have shrunk)
    # The job spec it was made with (engine.spec.fingerprint); spec_hash is its digest.
    fingerprint: dict | None = None

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data = json.loads(text)
        if data.get("format") != FORMAT:
            raise ValueError(f"unknown manifest format {data.get('format')!r}")
        data["files"] = tuple(FileEntry(**f) for f in data["files"])
        data["data_skips"] = tuple((int(first), int(count)) for first, count in data.get("data_skips") or ())
        if isinstance(data.get("members"), list):
            data["members"] = tuple(data["members"])
        # Fields a newer writer added are ignored: a rolling upgrade must not make steps vanish.
        known = {f.name for f in fields(cls)}
        manifest = cls(**{k: v for k, v in data.items() if k in known})
        manifest._check_types()
        return manifest

    def _check_types(self) -> None:
        """A hand-edited or damaged manifest ("step": "5") is not a manifest: readers format and
        compare these fields, and a wrong type there would raise far from here."""
        ints = [self.step, self.micro_step, self.world_size, self.host, self.hosts, self.format,
                *(f.size for f in self.files), *self.members]
        strs = [self.job, self.spec_hash, self.version, self.reason, *(f.path for f in self.files),
                *(f.crc32c for f in self.files)]
        if (any(type(v) is not int for v in ints) or any(not isinstance(v, str) for v in strs)
                or type(self.created_unix) not in (int, float) or not math.isfinite(self.created_unix)
                or not (self.wandb_run_id is None or isinstance(self.wandb_run_id, str))
                or not (self.fingerprint is None or isinstance(self.fingerprint, dict))
                or not isinstance(self.members, tuple)):
            raise ValueError("a manifest field has the wrong type")
        if min(self.step, self.micro_step, *(f.size for f in self.files), *self.members) < 0:
            raise ValueError("a manifest field is negative")

    @classmethod
    def describe(cls, directory: Path, **fields) -> Manifest:
        """The manifest of the files now in `directory`, with their sizes and CRC32C."""
        paths = [p for p in sorted(directory.rglob("*")) if p.is_file() and p.name != MANIFEST]
        checksums = _parallel(file_crc32c, paths)
        files = tuple(FileEntry(str(p.relative_to(directory)), p.stat().st_size, c) for p, c in zip(paths, checksums))
        return cls(files=files, **fields)




def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Durably write the commit marker: data files first, then the manifest, then the directory."""
    for entry in manifest.files:
        fsync_path(directory / entry.path)
    atomic_write(directory / MANIFEST, manifest.to_json())


def read_small(path: Path, limit: int = 64 << 20) -> str:
    """A small regular file's text. Anything else in its place (a FIFO, a device, a directory, a
    huge file) raises OSError instead of blocking the reader or filling its memory."""
    info = path.stat()
    if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
        raise OSError(f"{path}: not a regular file of at most {limit} bytes")
    return path.read_text()


def read_manifest(directory: Path) -> Manifest | None:
    try:
        return Manifest.from_json(read_small(directory / MANIFEST))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def problems(directory: Path, manifest: Manifest, *, checksums: bool) -> list[str]:
    """What is wrong with a committed directory: missing files, sizes, and CRC32C if asked."""
    found, present = [], []
    for entry in manifest.files:
        path = directory / entry.path
        if not path.is_file():
            found.append(f"{entry.path}: missing")
        elif path.stat().st_size != entry.size:
            found.append(f"{entry.path}: {path.stat().st_size} bytes, manifest says {entry.size}")
        else:
            present.append(entry)
    if checksums:
        actual = _parallel(file_crc32c, [directory / e.path for e in present])
        found += [f"{e.path}: CRC32C mismatch" for e, crc in zip(present, actual) if crc != e.crc32c]
    return found


def _parallel(fn, items: list) -> list:
    """google-crc32c releases the GIL: checksum files on every core."""
    if len(items) < 2:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(len(items), os.cpu_count() or 1)) as pool:
        return list(pool.map(fn, items))


GLOBAL = "global.json"


def write_global(directory: Path, manifest: Manifest) -> None:
    """Mark a part of a multi-host step globally committed: every host's part is durable."""
    atomic_write(directory / GLOBAL, json.dumps({"step": manifest.step, "micro_step": manifest.micro_step,
                                                 "hosts": manifest.hosts, "created_unix": time.time()}))


def is_global(directory: Path, manifest: Manifest) -> bool:
    """Whether a part is globally committed (a single host's manifest is its own commit)."""
    if manifest.hosts <= 1:
        return True
    try:
        marker = json.loads(read_small(directory / GLOBAL))
        return (marker["step"], marker["micro_step"]) == (manifest.step, manifest.micro_step)
    except (OSError, ValueError, TypeError, KeyError):
        return False


def committed_steps(job_dir: Path) -> list[tuple[int, Path, Manifest]]:
    """Committed checkpoints under <root>/<job>, oldest first (not yet verified): a parseable
    manifest, and for a job on several hosts the global marker."""
    return [item for item in parts(job_dir) if is_global(item[1], item[2])]


def parts(job_dir: Path) -> list[tuple[int, Path, Manifest]]:
    """Step directories with a parseable manifest, globally committed or not, oldest first."""
    found = []
    if job_dir.is_dir():
        for child in job_dir.iterdir():
            match = _STEP_DIR.match(child.name)
            if match and (manifest := read_manifest(child)) is not None and child.name == step_dir_name(
                    manifest.step, manifest.micro_step):
                found.append((manifest.step, child, manifest))
    return sorted(found, key=lambda item: (item[0], item[2].micro_step))


# The supervisor pins a step while it uploads it; local retention leaves pinned steps alone.
PINS = ".pins"


def pin(job_dir: Path, step: int) -> None:
    (job_dir / PINS).mkdir(parents=True, exist_ok=True)
    (job_dir / PINS / str(step)).touch()


def unpin(job_dir: Path, step: int) -> None:
    (job_dir / PINS / str(step)).unlink(missing_ok=True)


def pinned_steps(job_dir: Path) -> set[int]:
    pins = job_dir / PINS
    return {int(p.name) for p in pins.iterdir() if p.name.isdigit()} if pins.is_dir() else set()
