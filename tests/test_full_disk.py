"""Checkpoints on a real small file system (a tmpfs this test mounts; CI runs as root) that fills
up, turns read-only or loses its directory: saves fail, training does not."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from engine import events, exit_codes
from engine.checkpoint import manifest as mf
from engine.requests import Action, Request
from engine.train import Trainer
from testkit.recorders import Recorder

QUICK = ("train.log_interval=1", "scheduler.warmup_steps=1", "data.micro_batch_size=2", "data.seq_len=32",
         "checkpoint.interval_steps=4")

pytestmark = pytest.mark.slow  # training for real on a real (tmpfs) file system, as root


class SmallFs:
    """A tmpfs mounted for one test, with a filler file to make it as full as a test needs."""

    def __init__(self, mount: Path):
        self.mount = mount
        self.filler = mount / "filler"

    def free(self) -> int:
        return shutil.disk_usage(self.mount).free

    def leave(self, free_bytes: int) -> None:
        """Fill it up until `free_bytes` are left. A worker saving meanwhile may take some of the
        room between the measure and the write: the filler then gives that much back."""
        with open(self.filler, "ab", buffering=0) as f:
            try:
                f.write(b"\0" * max(0, self.free() - free_bytes))
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
        if (short := free_bytes - self.free()) > 0:
            os.truncate(self.filler, max(0, self.filler.stat().st_size - short))

    def make_room(self) -> None:
        self.filler.unlink(missing_ok=True)

    def remount(self, mode: str) -> None:
        subprocess.run(["mount", "-o", f"remount,{mode}", str(self.mount)], check=True)


@pytest.fixture
def small_fs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    mount = tmp_path / "small-fs"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96m", "tpud-test", str(mount)], check=True)
    try:
        yield SmallFs(mount)
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def ckpt_bytes(job_dir: Path, timeout: float = 60) -> int:
    """The size of the newest committed checkpoint, once there is one (an async save may still be writing)."""
    deadline = time.monotonic() + timeout
    while not (committed := mf.committed_steps(job_dir)):
        assert time.monotonic() < deadline, "no checkpoint committed"
        time.sleep(0.01)
    return committed[-1][2].total_bytes


def tmp_dirs(job_dir: Path) -> list[Path]:
    return list(job_dir.glob(".tmp-*"))


def run(spec, home, hooks) -> tuple[int, Trainer]:
    trainer = Trainer(spec, home, hooks)
    return trainer.run(), trainer


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_full_disk_fails_the_save_and_training_goes_on_until_space_is_freed(tiny_spec, tmp_path, small_fs, mode):
    spec = tiny_spec(*QUICK, "train.max_steps=16", f"checkpoint.dir={small_fs.mount}",
                     f"checkpoint.async={mode == 'async'}")
    job_dir = small_fs.mount / "tiny-cpu"
    freed = []

    def free_after_two_failures(fields):
        if len(hooks.of(events.CheckpointFailed)) == 2:
            small_fs.make_room()
            freed.append(fields.step)

    hooks = Recorder({(5, 0): lambda: small_fs.leave(ckpt_bytes(job_dir) // 2)},  # room for half a checkpoint
                   {events.CheckpointFailed: free_after_two_failures})
    code, trainer = run(spec, tmp_path, hooks)

    assert code == exit_codes.OK
    failed = hooks.of(events.CheckpointFailed)
    assert [f.step for f in failed] == [8, 12] and freed == [12]
    assert all("No space left on device (ENOSPC)" in f.error for f in failed), failed
    assert [f.failures for f in failed] == [1, 2]
    assert [step for step, _, _ in mf.committed_steps(job_dir)] == [4, 16]  # the next save after freeing
    assert trainer.checkpointer.failures == 0
    assert tmp_dirs(job_dir) == []  # removed at once: no restart happened to clean up
    assert max(e.step for e in hooks.of(events.Step)) == 16


@pytest.mark.parametrize("pinned", [False, True])
def test_before_a_save_older_steps_make_room_but_never_the_newest_or_a_pinned_one(tiny_spec, tmp_path, small_fs,
                                                                                 pinned):
    spec = tiny_spec(*QUICK, "train.max_steps=12", f"checkpoint.dir={small_fs.mount}", "checkpoint.keep=3",
                     "checkpoint.async=false")
    job_dir = small_fs.mount / "tiny-cpu"

    def fill():
        if pinned:
            mf.pin(job_dir, 4)  # as the supervisor does while it uploads step 4
        small_fs.leave(ckpt_bytes(job_dir) * 3 // 4)

    hooks = Recorder({(9, 0): fill}, {events.CheckpointFailed: lambda _: small_fs.make_room()})
    code, _ = run(spec, tmp_path, hooks)

    assert code == exit_codes.OK
    steps = [step for step, _, _ in mf.committed_steps(job_dir)]
    if pinned:  # nothing could go: step 12's first save failed, the retry after the disk was freed committed
        assert [f.step for f in hooks.of(events.CheckpointFailed)] == [12] and steps == [4, 8, 12]
    else:  # step 4 went to make room; step 8, the newest, stayed
        assert hooks.of(events.CheckpointFailed) == [] and steps == [8, 12]
    assert tmp_dirs(job_dir) == []


def test_a_failed_save_for_an_exit_still_exits_75_and_leaves_the_newest_step_whole(tiny_spec, tmp_path, small_fs):
    spec = tiny_spec(*QUICK, "train.max_steps=50", f"checkpoint.dir={small_fs.mount}")
    job_dir = small_fs.mount / "tiny-cpu"

    def fill_then_stop():
        small_fs.leave(ckpt_bytes(job_dir) // 2)
        return Request(Action.CHECKPOINT_AND_EXIT, deadline_s=0.0)

    hooks = Recorder({(6, 0): fill_then_stop})
    code, _ = run(spec, tmp_path, hooks)

    assert code == exit_codes.STOPPED
    assert [f.reason for f in hooks.of(events.CheckpointFailed)] == ["request"]
    ((step, path, manifest),) = mf.committed_steps(job_dir)
    assert step == 4 and mf.problems(path, manifest, checksums=True) == []
    assert tmp_dirs(job_dir) == []


def test_the_final_checkpoint_is_retried_until_it_commits(tiny_spec, tmp_path, small_fs):
    spec = tiny_spec(*QUICK, "train.max_steps=6", f"checkpoint.dir={small_fs.mount}")
    job_dir = small_fs.mount / "tiny-cpu"
    hooks = Recorder({(5, 0): lambda: small_fs.leave(ckpt_bytes(job_dir) // 2)},
                   {events.CheckpointFailed: lambda f: small_fs.make_room() if f.failures == 2 else None})
    started = time.monotonic()
    code, _ = run(spec, tmp_path, hooks)

    assert code == exit_codes.OK
    assert [(f.step, f.reason) for f in hooks.of(events.CheckpointFailed)] == [(6, "final"), (6, "final")]
    assert [step for step, _, _ in mf.committed_steps(job_dir)] == [4, 6]
    assert time.monotonic() - started < 60  # retried after 1 s, then 2 s


def test_a_stop_while_the_final_checkpoint_cannot_be_written_exits_75(tiny_spec, tmp_path, small_fs):
    spec = tiny_spec(*QUICK, "train.max_steps=6", f"checkpoint.dir={small_fs.mount}")
    job_dir = small_fs.mount / "tiny-cpu"
    hooks = Recorder({(5, 0): lambda: small_fs.leave(ckpt_bytes(job_dir) // 2)})
    # `tpud stop` arrives while the worker waits to retry: it is polled there, at step 6.
    hooks.on[events.CheckpointFailed] = lambda f: hooks.requests.update({(6, 0): lambda: Request(Action.STOP)})
    code, _ = run(spec, tmp_path, hooks)
    assert code == exit_codes.STOPPED
    assert [step for step, _, _ in mf.committed_steps(job_dir)] == [4]


def test_a_read_only_file_system_fails_saves_until_it_is_writable_again(tiny_spec, tmp_path, small_fs):
    spec = tiny_spec(*QUICK, "train.max_steps=12", f"checkpoint.dir={small_fs.mount}", "checkpoint.async=false")
    job_dir = small_fs.mount / "tiny-cpu"
    hooks = Recorder({(5, 0): lambda: small_fs.remount("ro")},
                   {events.CheckpointFailed: lambda _: small_fs.remount("rw")})
    code, _ = run(spec, tmp_path, hooks)

    assert code == exit_codes.OK
    (failed,) = hooks.of(events.CheckpointFailed)
    assert failed.step == 8 and "(EROFS)" in failed.error
    assert [step for step, _, _ in mf.committed_steps(job_dir)] == [4, 12]
    assert tmp_dirs(job_dir) == []


def test_a_checkpoint_directory_deleted_under_the_job_is_made_again(tiny_spec, tmp_path):
    spec = tiny_spec(*QUICK, "train.max_steps=8", "checkpoint.async=false")
    job_dir = tmp_path / "checkpoints" / "tiny-cpu"
    hooks = Recorder({(5, 0): lambda: shutil.rmtree(job_dir)})
    code, _ = run(spec, tmp_path, hooks)
    assert code == exit_codes.OK
    assert hooks.of(events.CheckpointFailed) == []
    assert [step for step, _, _ in mf.committed_steps(job_dir)] == [8]


def test_under_the_daemon_a_full_disk_warns_counts_and_never_restarts(tmp_path, small_fs):
    from prometheus_client.parser import text_string_to_metric_families

    from testkit.helpers import Daemon, job_text

    (tmp_path / "jobs.d").mkdir()
    job_dir = small_fs.mount / "disk"
    daemon = Daemon(tmp_path)
    try:
        text = job_text("disk", max_steps=150)
        assert "checkpoint: {interval_steps: 0}" in text
        (tmp_path / "jobs.d" / "disk.yaml").write_text(text.replace(
            "checkpoint: {interval_steps: 0}", f"checkpoint: {{interval_steps: 10, dir: {small_fs.mount}}}"))
        deadline = time.monotonic() + 120
        while not mf.committed_steps(job_dir):
            assert time.monotonic() < deadline, daemon.tail()
            time.sleep(0.1)
        # Room for half a checkpoint once a save has made room by deleting the older steps (never the
        # newest): the next save fails. Measured and filled with the worker stopped: a save that
        # committed while the filler was written once left room for a whole one in CI.
        worker = daemon.status()["disk"]["pid"]
        os.kill(worker, signal.SIGSTOP)
        try:
            *older, newest = mf.committed_steps(job_dir)
            small_fs.leave(max(0, newest[2].total_bytes // 2 - sum(m.total_bytes for _, _, m in older)))
        finally:
            os.kill(worker, signal.SIGCONT)

        jobs = daemon.wait_for(lambda j: j["disk"]["warnings"], "a warning in tpud status")
        (warning,) = jobs["disk"]["warnings"]
        assert warning.startswith("local checkpoint failed") and "No space left on device (ENOSPC)" in warning
        assert jobs["disk"]["state"] == "RUNNING" and jobs["disk"]["restarts"] == 0
        # The table, read again while it may lag (a save begun before the disk filled can still
        # commit and clear the streak once; the next interval's fails again).
        deadline = time.monotonic() + 60
        while "disk: warning: local checkpoint failed" not in (table := daemon.cli("status").stdout):
            assert time.monotonic() < deadline, table
            time.sleep(0.5)
        address = (tmp_path / "run" / "metrics.addr").read_text().strip()
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
            families = text_string_to_metric_families(response.read().decode())
        failures = [s.value for f in families for s in f.samples
                    if s.name == "tpud_checkpoint_failures_total" and s.labels == {"job": "disk", "tier": "local"}]
        assert failures and failures[0] >= 1

        small_fs.make_room()
        jobs = daemon.wait_for(lambda j: j["disk"]["state"] == "SUCCEEDED", "the job to finish", timeout=300)
        assert jobs["disk"]["restarts"] == 0 and jobs["disk"]["warnings"] == []
        assert mf.committed_steps(job_dir)[-1][0] == 150
        assert tmp_dirs(job_dir) == []
    finally:
        daemon.proc.kill()  # its workers die with it (PR_SET_PDEATHSIG)
        daemon.proc.wait()


def test_a_failure_after_the_commit_does_not_report_the_committed_step_as_failed(tiny_spec, tmp_path, monkeypatch):
    from engine.checkpoint import retention

    def retention_fails(job_dir, keep, several_hosts):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(retention, "retain", retention_fails)
    spec = tiny_spec(*QUICK, "train.max_steps=4", "checkpoint.async=false")
    hooks = Recorder()
    code, trainer = run(spec, tmp_path, hooks)
    assert code == exit_codes.OK and hooks.of(events.CheckpointFailed) == []
    assert [f.step for f in hooks.of(events.CheckpointCommitted)] == [4] and trainer.checkpointer.failures == 0


def test_prepare_on_a_full_disk_fails_cleanly_and_a_rerun_after_making_room_succeeds(small_fs, tmp_path):
    from engine.data import manifest as dm
    from engine.prepare.pipeline import prepare
    from engine.prepare.options import Options

    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"text": "x" * 1000 + str(i)}) + "\n" for i in range(3000)))  # ~3 MB
    out = small_fs.mount / "ds"
    options = Options(inputs=(str(source),), tokenizer="bytes", out=str(out), workers=1, progress=False,
                      shard_tokens=200_000)
    small_fs.leave(1 << 20)  # 1 MiB: the shards need about 6
    with pytest.raises(OSError) as failed:
        prepare(options)
    assert failed.value.errno == errno.ENOSPC
    assert not (out / dm.MANIFEST).exists() and not (out / ".incomplete").exists()  # the space is given back
    small_fs.make_room()
    manifest = prepare(options)
    assert manifest.splits["train"].documents == 3000 and dm.read(out) == manifest


def test_export_on_a_full_disk_fails_cleanly_and_succeeds_once_there_is_room(tiny_spec, tmp_path, small_fs):
    from engine.hf.export import ExportError, export

    spec = tiny_spec(*QUICK, "train.max_steps=2")
    assert Trainer(spec, tmp_path / "home", Recorder()).run() == exit_codes.OK
    step = mf.committed_steps(tmp_path / "home" / "checkpoints" / "tiny-cpu")[-1]
    out = small_fs.mount / "model"
    weights = 3281408  # the tiny preset in fp32
    small_fs.leave(1 << 20)
    with pytest.raises(ExportError, match=r"small-fs: 1.0 MB free, the weights need 3.3 MB"):
        export(spec, step[1], out, dtype="fp32")
    small_fs.make_room()
    small_fs.leave(weights + 4096)  # the weights fit, but not with their header and the config files
    with pytest.raises(OSError, match="No space left"):
        export(spec, step[1], out, dtype="fp32")
    assert sorted(p.name for p in small_fs.mount.iterdir()) == ["filler"]  # nothing half-written is left
    small_fs.make_room()
    assert (out / "model.safetensors") in export(spec, step[1], out, dtype="fp32")
