"""How tpud writes its small files to disk: durably and all at once. Torch-free.

Every record a crash must not tear (job.json, spec.json, data_skips.json, a checkpoint's
manifest, fault markers, metrics.addr) goes through `atomic_write`: a reader sees the old
file or the whole new one, and once it returns the new one survives a power cut.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["atomic_write", "fsync_path"]


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
