"""engine.layout.atomic_write: a reader sees the old file or the whole new one; nothing is left behind."""

from __future__ import annotations

import os
import stat

import pytest

from engine import layout
from engine.layout import atomic_write


def test_it_creates_and_replaces_whole_files_readable_by_all(tmp_path):
    path = tmp_path / "a" / "b" / "job.json"
    atomic_write(path, "one")
    atomic_write(path, b"two")
    assert path.read_text() == "two"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert sorted(p.name for p in path.parent.iterdir()) == ["job.json"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "job.json"
    atomic_write(path, "old")

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(layout.os, "replace", full_disk)
    with pytest.raises(OSError):
        atomic_write(path, "new")
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["job.json"]
