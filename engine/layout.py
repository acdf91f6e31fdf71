"""Where a job's files live in the state directory, and how the small ones are written. Torch-free.

    <state>/jobs/<job>/job.json          the daemon's record of the job (restarts, goodput, history)
    <state>/jobs/<job>/spec.json         the validated spec a worker trains
    <state>/jobs/<job>/data_skips.json   micro-batches skipped after non-finite losses
    <state>/jobs/<job>/xla_cache/        torch_xla's compilation cache
    <state>/jobs/<job>/inductor_cache/   torch.compile's (Inductor's and Triton's) caches, cpu and cuda
    <checkpoint.dir or <state>/checkpoints>/<job>/step_*/   the local checkpoint tier
    <state>/datasets/<key>/              gs:// datasets fetched to this host, shared by its jobs
    <state>/models/<key>/                gs:// model.init_from directories fetched, likewise

The worker, the daemon and `tpud checkpoints` all find these through `StateLayout`.

Every record a crash must not tear (job.json, spec.json, data_skips.json, a checkpoint's
manifest, fault markers, metrics.addr) goes through `atomic_write`: a reader sees the old
file or the whole new one, and once it returns the new one survives a power cut.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["StateLayout", "atomic_write", "fsync_path"]


@dataclass(frozen=True)
class StateLayout:
    state: Path

    def job_dir(self, job: str) -> Path:
        return self.state / "jobs" / job

    def gang_file(self, job: str) -> Path:
        """The newest gang this host's workers formed for the job (tpud/worker/gang/stores.py: Known)."""
        return self.job_dir(job) / "gang.json"

    def record_file(self, job: str) -> Path:
        return self.job_dir(job) / "job.json"

    def spec_file(self, job: str) -> Path:
        return self.job_dir(job) / "spec.json"

    def skips_file(self, job: str) -> Path:
        return self.job_dir(job) / "data_skips.json"

    def xla_cache(self, job: str) -> Path:
        return self.job_dir(job) / "xla_cache"

    def inductor_cache(self, job: str) -> Path:
        return self.job_dir(job) / "inductor_cache"

    def datasets(self) -> Path:
        return self.state / "datasets"

    def models(self) -> Path:
        """gs:// model.init_from directories, cached (engine/hf/remote.py)."""
        return self.state / "models"

    def checkpoints(self, job: str, override: str | os.PathLike[str] | None = None) -> Path:
        """The job's local checkpoint tier; `override` is the spec's checkpoint.dir."""
        return Path(override or self.state / "checkpoints") / job


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync a file or a directory (a directory's fsync makes its new entries durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike[str], data: str | bytes, *, mode: int = 0o644) -> None:
    """Replace `path` with `data` atomically and durably, creating its directory if needed.

    The temporary file is unique and hidden (`.NAME.*.tmp`), so processes writing the same
    path never collide, and it is removed when the write fails (a full disk, say).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_path(path.parent)
