"""The demo corpus: Python's own standard-library source, present on every machine.

Files are read in sorted path order, so the corpus is the same on every run of the same
Python installation; nothing is downloaded.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_corpus(max_bytes: int) -> np.ndarray:
    """Byte tokens of the stdlib's .py files, concatenated, up to max_bytes."""
    return stdlib_documents(max_bytes)[0]


def stdlib_documents(max_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """The corpus, and its document index as a prepared split stores it (engine.data.shards):
    0, then where each file ends."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if _SKIP_DIRS.intersection(path.relative_to(root).parts):
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue  # unreadable files are simply not part of the corpus
        chunks.append(data[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    if total == 0:
        raise FileNotFoundError(f"no Python source found under {root}")
    ends = np.cumsum([0] + [len(chunk) for chunk in chunks], dtype=np.uint64)
    return np.frombuffer(b"".join(chunks), dtype=np.uint8), ends
