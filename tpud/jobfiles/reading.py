"""Which job files exist and what they say.

`scan(directory)` reads every job file (`*.yaml`, `*.yml`) directly in the jobs directory and
returns one `JobFile` per file: its path, the sha256 of its bytes, and either the validated
`JobSpec` (with where each key was set) or the error (`FILE:LINE: KEY: MESSAGE` lines, as
`tpud validate` prints them). Editor droppings (swap, backup, lock and temp files) and dot
files are not job files.

Torch-free: the daemon's reader process imports this.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from engine.files import Refused, read_regular_file
from engine.spec.loader import LIMITS, LoadedSpec, Origin, SpecError, load_job
from engine.spec.schema import JobSpec

log = structlog.get_logger()

JOB_SUFFIXES = (".yaml", ".yml")

# Names that are never job files even when they end in .yaml: editor and package-manager
# droppings. Dot files (.#x emacs locks, .x.swp vim swap, .x.tmp123 temp files) go by the
# leading dot.
_IGNORED_PREFIXES = (".", "#")  # .hidden, .#x (emacs lock), #x# (emacs autosave)
_IGNORED_SUFFIXES = ("~", "#", ".swp", ".swo", ".swx", ".tmp", ".bak", ".orig", ".rej", ".part")
_IGNORED_NAMES = frozenset({"4913"})  # vim's probe file
_IGNORED_INFIXES = (".dpkg-", ".ucf-", ".rpmnew", ".rpmsave")
_READ_ATTEMPTS = 3


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
    `origins` says where each dotted key of `spec` was set.
    """

    path: Path
    digest: str
    spec: JobSpec | None
    error: str | None
    origins: Mapping[str, Origin] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if (self.spec is None) == (self.error is None):
            raise ValueError("a JobFile has exactly one of spec and error")

    @classmethod
    def invalid(cls, path: Path, digest: str, error: str) -> JobFile:
        return cls(path, digest, None, error)

    @property
    def loaded(self) -> LoadedSpec:
        assert self.spec is not None
        return LoadedSpec(self.spec, self.origins)


def scan(directory: Path, *more: Path) -> dict[Path, JobFile]:
    """Every job file directly in `directory` (and in `more`, after it), keyed by path, in sorted order.

    A file that vanishes while being read is left out; one that cannot be read (a directory,
    FIFO or device named like a job file, a file over the size limit), or does not hold a
    valid job, is there with its error. A missing directory holds no job files. When
    two files declare the same job name, the later one (by directory, then path) gets the error.
    """
    found: dict[Path, JobFile] = {}
    for folder in (Path(directory), *map(Path, more)):
        try:
            with os.scandir(folder) as entries:
                names = sorted(entry.name for entry in entries if is_job_file(entry.name))
        except (FileNotFoundError, NotADirectoryError):
            names = []
        for name in names:
            job = _read_job(folder / name)
            if job is not None:
                found[job.path] = job

    owners: dict[str, Path] = {}
    for path, job in found.items():
        if job.spec is None:
            continue
        owner = owners.setdefault(job.spec.name, path)
        if owner != path:
            problem = job.loaded.problem("name", f"job {job.spec.name} is already defined in {owner}")
            found[path] = JobFile.invalid(path, job.digest, str(problem))
    return found


def _read_job(path: Path) -> JobFile | None:
    """The job file at `path`, or None when it no longer exists."""
    raw = _read_bytes(path)
    for _ in range(_READ_ATTEMPTS):
        if isinstance(raw, JobFile) or raw is None:
            return raw
        digest = hashlib.sha256(raw).hexdigest()
        job = _parse(path, digest)
        # load_job read the file again: keep the result only if that was the same version.
        again = _read_bytes(path)
        if isinstance(again, bytes) and again == raw:
            return job
        raw = again
    if isinstance(raw, bytes):
        digest = hashlib.sha256(raw).hexdigest()
        return JobFile.invalid(path, digest, f"{path}: the file kept changing while it was being read")
    return raw


def _read_bytes(path: Path) -> bytes | JobFile | None:
    """The file's bytes; a JobFile with the error when it cannot be a job file (a FIFO, a
    device, a directory, too large: refused without a blocking read); None when it is gone."""
    try:
        return read_regular_file(path, LIMITS.file_bytes)
    except FileNotFoundError:
        if os.path.islink(path):  # a dangling symlink is a job file that cannot be read
            return JobFile.invalid(path, "", f"{path}: cannot read: the symlink's target does not exist")
        return None  # removed between listing and reading
    except OSError as e:
        return JobFile.invalid(path, "", f"{path}: cannot read: {e.strerror or e}")
    except Refused as e:
        return JobFile.invalid(path, "", f"{path}: cannot read: {e}")


def _parse(path: Path, digest: str) -> JobFile:
    try:
        loaded = load_job(path)
    except SpecError as e:
        return JobFile.invalid(path, digest, str(e))
    except Exception as e:  # noqa: BLE001 - a strange file must never take the daemon down
        log.exception("job file: unexpected error while loading", path=str(path))
        return JobFile.invalid(path, digest, f"{path}: cannot load: {type(e).__name__}: {e}")
    return JobFile(path, digest, loaded.spec, None, loaded.origins)
