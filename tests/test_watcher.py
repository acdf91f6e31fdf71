"""The jobs directory: scan() (what job files exist and say) and Watcher (when to rescan)."""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

import tpud.jobfiles.reading as reading
from tpud.jobfiles.reading import JobFile, is_job_file, scan
from tpud.jobfiles.watcher import Watcher
from testkit.helpers import write

pytestmark = pytest.mark.timeout(60)



class Calls:
    """on_change that counts calls; wait_for(n) blocks until there were n."""

    def __init__(self, also=None):
        self.count = 0
        self.cond = threading.Condition()
        self.also = also
        self.threads: set[str] = set()

    def __call__(self) -> None:
        if self.also:
            self.also()
        with self.cond:
            self.count += 1
            self.threads.add(threading.current_thread().name)
            self.cond.notify_all()

    def wait_for(self, n: int, timeout: float = 5.0) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.count >= n, timeout)

    def settled(self, quiet: float) -> int:
        """The count once no call came for `quiet` seconds."""
        with self.cond:
            while True:
                before = self.count
                self.cond.wait(quiet)
                if self.count == before:
                    return before


@pytest.fixture
def jobs(tmp_path) -> Path:
    path = tmp_path / "jobs.d"
    path.mkdir()
    return path


# --- scan ---


def test_scan_reads_yaml_and_yml_files(jobs):
    a = write(jobs, "alpha.yaml", "name: first\ntrain:\n  max_steps: 7\n")
    b = write(jobs, "Beta.yml", "train:\n  max_steps: 9\n")
    write(jobs, "notes.txt", "not a job")
    (jobs / "sub").mkdir()
    write(jobs / "sub", "nested.yaml", "name: nested\n")  # not directly in the directory

    found = scan(jobs)

    assert list(found) == sorted([a, b])
    assert found[a] == JobFile(a, hashlib.sha256(a.read_bytes()).hexdigest(), found[a].spec, None)
    assert found[a].spec.name == "first" and found[a].spec.train.max_steps == 7
    assert found[b].spec.name == "beta"  # the name defaults to the lowercased stem
    assert found[b].error is None and found[b].spec is not None


def test_scan_of_a_missing_directory_is_empty(tmp_path):
    assert scan(tmp_path / "nope") == {}


IGNORED = [
    ".hidden.yaml",
    ".#job.yaml",  # emacs lock
    "#job.yaml#",  # emacs autosave
    "#job.yaml",
    "job.yaml~",  # emacs / vim backup
    ".job.yaml.swp",  # vim swap
    ".job.yaml.swo",
    "job.yaml.swx",
    "job.swx",
    "4913",  # vim's probe
    "job.yaml.tmp",
    "job.tmp",
    "job.yaml.bak",
    "job.yaml.orig",
    "job.yaml.dpkg-dist",
    "job.yaml.dpkg-old",
    "job.dpkg-new.yaml",
    "job.yaml.rpmnew",
    ".job.yaml.Xy12ab",  # write-temp-then-rename temp files
    ".yaml",
    "job.json",
]


@pytest.mark.parametrize("name", IGNORED)
def test_editor_and_package_leftovers_are_not_job_files(name):
    assert not is_job_file(name)


@pytest.mark.parametrize("name", ["job.yaml", "job.yml", "my-job.v2.yaml", "a"])
def test_job_file_names(name):
    assert is_job_file(name) == (name != "a")


def test_scan_skips_ignored_names(jobs):
    job = write(jobs, "job.yaml", "name: job\n")
    for name in IGNORED:
        write(jobs, name, "name: job\n")  # would be a duplicate name if it were read
    os.symlink(jobs / "nowhere", jobs / ".#other.yaml")  # emacs lock files are dangling symlinks

    found = scan(jobs)
    assert list(found) == [job] and found[job].spec is not None


def test_yaml_syntax_error_is_located(jobs):
    path = write(jobs, "broken.yaml", "train:\n  max_steps: [1, 2\n")
    job = scan(jobs)[path]
    assert job.spec is None
    assert job.error.startswith(f"{path}:3: invalid YAML")
    assert job.digest == hashlib.sha256(path.read_bytes()).hexdigest()


def test_unknown_key_is_located(jobs):
    path = write(jobs, "typo.yaml", "name: typo\ntrain:\n  max_stepz: 10\n")
    job = scan(jobs)[path]
    assert job.spec is None
    assert job.error.startswith(f"{path}:3: train.max_stepz: unknown key")
    assert "did you mean 'max_steps'?" in job.error


def test_every_problem_is_reported_one_per_line(jobs):
    path = write(jobs, "two.yaml", "name: two\ntrain:\n  max_steps: 0\n  max_stepz: 1\n")
    lines = scan(jobs)[path].error.splitlines()
    assert len(lines) == 2 and all(line.startswith(f"{path}:") for line in lines)


def test_read_error_is_an_error(jobs, monkeypatch):
    path = write(jobs, "job.yaml", "name: job\n")
    real = reading.read_regular_file

    def read(file, *args):
        if Path(file) == path:  # as root (CI), chmod cannot make a file unreadable
            raise PermissionError(13, "Permission denied")
        return real(file, *args)

    monkeypatch.setattr(reading, "read_regular_file", read)
    assert scan(jobs)[path] == JobFile(path, "", None, f"{path}: cannot read: Permission denied")


def test_fifos_devices_and_directories_are_refused_without_reading(jobs):
    os.mkfifo(jobs / "pipe.yaml")  # reading it would block until a writer comes
    os.symlink("/dev/zero", jobs / "zero.yaml")  # reading it would never end
    (jobs / "dir.yaml").mkdir()
    found = scan(jobs)
    assert {path.name: job.error for path, job in found.items()} == {
        "dir.yaml": f"{jobs / 'dir.yaml'}: cannot read: a directory, not a regular file",
        "pipe.yaml": f"{jobs / 'pipe.yaml'}: cannot read: a FIFO, not a regular file",
        "zero.yaml": f"{jobs / 'zero.yaml'}: cannot read: a symlink to /dev/zero, a character device, "
                     "not a regular file",
    }


def test_dangling_symlink_is_an_error(jobs, tmp_path):
    path = jobs / "linked.yaml"
    os.symlink(tmp_path / "gone.yaml", path)
    job = scan(jobs)[path]
    assert job.spec is None and "cannot read" in job.error


def test_file_that_vanishes_while_scanning_is_skipped(jobs, monkeypatch):
    keep = write(jobs, "keep.yaml", "name: keep\n")
    gone = write(jobs, "gone.yaml", "name: gone\n")
    listed = reading.is_job_file

    def is_job_file_then_delete(name: str) -> bool:
        if name == gone.name and gone.exists():
            gone.unlink()  # listed, then gone before it is read
        return listed(name)

    monkeypatch.setattr(reading, "is_job_file", is_job_file_then_delete)
    assert list(scan(jobs)) == [keep]


def test_duplicate_job_names_are_reported_on_the_later_file(jobs):
    a = write(jobs, "a.yaml", "name: same\n")
    b = write(jobs, "b.yaml", "# comment\nname: same\ntrain:\n  max_steps: 5\n")
    same = write(jobs, "same.yaml", "train:\n  max_steps: 5\n")  # the default name collides too
    other = write(jobs, "other.yaml", "name: other\n")

    found = scan(jobs)
    assert found[a].spec and found[other].spec
    assert found[b].spec is None
    assert found[b].error == f"{b}:2: name: job same is already defined in {a}"
    assert found[same].error == f"{same}: name: job same is already defined in {a} [the name defaults to the file name]"
    assert found[b].digest == hashlib.sha256(b.read_bytes()).hexdigest()

    a.unlink()  # the next file in order now owns the name
    found = scan(jobs)
    assert found[b].spec and f"already defined in {b} " in found[same].error


def test_a_changed_include_is_seen_though_the_job_file_is_the_same(jobs, tmp_path):
    write(tmp_path, "base.yaml", "train:\n  max_steps: 10\n")
    job = write(jobs, "job.yaml", "include: ../base.yaml\nname: job\n")
    first = scan(jobs)[job]
    assert first.spec.train.max_steps == 10

    write(tmp_path, "base.yaml", "train:\n  max_steps: 20\n")
    again = scan(jobs)[job]
    assert again.spec.train.max_steps == 20 and again.digest == first.digest


# --- Watcher ---


@pytest.fixture
def watch(jobs):
    """Start a Watcher on `jobs`; stopped at the end of the test."""
    started: list[Watcher] = []

    def make(on_change, directory: Path = jobs, **kwargs) -> Watcher:
        kwargs.setdefault("debounce_s", 0.1)
        kwargs.setdefault("rescan_s", 60.0)
        w = Watcher(directory, on_change, **kwargs)
        w.start()
        started.append(w)
        return w

    yield make
    for w in started:
        w.stop()


def test_a_burst_of_writes_fires_once(jobs, watch):
    calls = Calls()
    watch(calls, debounce_s=0.2)
    path = jobs / "job.yaml"
    for i in range(20):  # 20 writes in about 100 ms
        path.write_text(f"name: job\ntrain:\n  max_steps: {i + 1}\n")
        time.sleep(0.005)
    assert calls.wait_for(1)
    assert calls.settled(0.5) in (1, 2)
    assert calls.threads == {"tpud-watcher"}
    assert scan(jobs)[path].spec.train.max_steps == 20


def test_scanning_from_on_change_does_not_fire_again(jobs, watch):
    write(jobs, "a.yaml", "name: a\n")
    seen: list[dict] = []
    calls = Calls(also=lambda: seen.append(scan(jobs)))
    watch(calls)
    write(jobs, "b.yaml", "name: b\n")
    assert calls.wait_for(1)
    assert calls.settled(0.4) == 1  # the scan's own reads are not changes
    assert [p.name for p in seen[-1]] == ["a.yaml", "b.yaml"]


def test_write_temp_then_rename_is_seen_complete(jobs, watch):
    path = write(jobs, "job.yaml", "name: job\ntrain:\n  max_steps: 1\n")
    seen: list[dict] = []
    calls = Calls(also=lambda: seen.append(scan(jobs)))
    watch(calls)

    temp = jobs / ".job.yaml.tmp3f9a"
    with open(temp, "w") as f:  # written slowly, in pieces
        f.write("name: job\n")
        f.flush()
        time.sleep(0.02)
        f.write("train:\n  max_steps: 2\n")
    os.replace(temp, path)

    assert calls.wait_for(1)
    calls.settled(0.3)
    assert list(seen[-1]) == [path]
    assert seen[-1][path].spec.train.max_steps == 2
    assert all(job.spec is not None for found in seen for job in found.values())  # never a half-written file


def test_vim_style_save_is_seen(jobs, watch):
    path = write(jobs, "job.yaml", "name: job\n")
    calls = Calls()
    watch(calls)
    (jobs / "4913").write_text("")
    (jobs / "4913").unlink()
    os.rename(path, jobs / "job.yaml~")
    write(jobs, "job.yaml", "name: job\ntrain:\n  max_steps: 4\n")
    (jobs / "job.yaml~").unlink()
    assert calls.wait_for(1)
    assert scan(jobs)[path].spec.train.max_steps == 4


def test_delete_fires(jobs, watch):
    path = write(jobs, "job.yaml", "name: job\n")
    calls = Calls()
    watch(calls)
    path.unlink()
    assert calls.wait_for(1)
    assert scan(jobs) == {}


def test_backstop_rescan_fires_without_events(watch):
    calls = Calls()
    watch(calls, rescan_s=0.1)
    assert calls.wait_for(3, timeout=3)


def test_missing_directory_is_created(tmp_path, watch):
    directory = tmp_path / "a" / "b" / "jobs.d"
    calls = Calls()
    watch(calls, directory)
    assert directory.is_dir()
    write(directory, "job.yaml", "name: job\n")
    assert calls.wait_for(1)


def test_directory_deleted_and_recreated(jobs, watch):
    calls = Calls()
    watch(calls, poll_s=0.05)
    write(jobs, "old.yaml", "name: old\n")
    assert calls.wait_for(1)
    n = calls.settled(0.2)

    shutil.rmtree(jobs)
    assert calls.wait_for(n + 1)
    assert scan(jobs) == {}

    jobs.mkdir()
    n = calls.settled(0.3)  # the watcher re-arms on the new directory (and says so)
    new = write(jobs, "new.yaml", "name: new\n")
    assert calls.wait_for(n + 1)
    assert list(scan(jobs)) == [new]


def test_directory_replaced_by_rename(jobs, watch):
    calls = Calls()
    watch(calls, poll_s=0.05)
    jobs.rename(jobs.with_name("old.d"))
    jobs.mkdir()
    n = calls.settled(0.3)
    write(jobs, "job.yaml", "name: job\n")
    assert calls.wait_for(n + 1)


def test_on_change_errors_do_not_stop_the_watcher(jobs, watch):
    calls = Calls()

    def failing():
        calls()
        raise RuntimeError("boom")

    watch(failing)
    write(jobs, "a.yaml", "name: a\n")
    assert calls.wait_for(1)
    calls.settled(0.2)
    write(jobs, "b.yaml", "name: b\n")
    assert calls.wait_for(2)


def test_stop_joins_its_threads_and_stops_calling(jobs):
    before = set(threading.enumerate())
    calls = Calls()
    w = Watcher(jobs, calls, debounce_s=0.05, rescan_s=0.1)
    w.start()
    assert calls.wait_for(1)
    assert len(set(threading.enumerate()) - before) >= 2  # the watcher's and watchdog's

    w.stop()
    assert set(threading.enumerate()) - before == set()
    n = calls.count
    write(jobs, "job.yaml", "name: job\n")
    time.sleep(0.3)
    assert calls.count == n
    w.stop()  # idempotent


def test_stop_from_on_change_does_not_deadlock(jobs):
    done = threading.Event()
    w: Watcher

    def on_change():
        w.stop()
        done.set()

    w = Watcher(jobs, on_change, rescan_s=0.05)
    w.start()
    assert done.wait(5)


def test_constructor_rejects_bad_timings(jobs):
    with pytest.raises(ValueError):
        Watcher(jobs, lambda: None, rescan_s=0)
    with pytest.raises(ValueError):
        Watcher(jobs, lambda: None, debounce_s=-1)
