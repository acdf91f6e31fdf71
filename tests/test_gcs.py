"""The GCS tier against a real GCS server (fake-gcs-server, testkit/gcs_server.py)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import structlog
from google.cloud.storage import Blob

from engine.checkpoint.manifest import (
    MANIFEST,
    Manifest,
    committed_steps,
    file_crc32c,
    pin,
    pinned_steps,
    problems,
    read_manifest,
    step_dir_name,
    write_manifest,
)
from engine.checkpoint.policy import SecondsPolicy, young_seconds
from testkit.gcs_server import GcsServer
from tpud.gcs.tier import GcsTier, RemoteConflict, RemoteCorrupt, RemoteUnavailable, RetryPolicy
from tpud.gcs.uploader import Uploader, ensure_newest_local

BUCKET = "tpud-test"
REMOTE = f"gs://{BUCKET}/ckpt/run1"
JOB = "job"
FAST = RetryPolicy(initial=0.05, maximum=0.5, deadline=30.0, request_timeout=10.0)


def make_step(job_dir: Path, step: int, sizes=(1 << 20, 1 << 20, 300_000, 1000), seed: int = 0,
              micro_step: int = 0) -> Path:
    """A committed local step directory: random DCP-like files + manifest.json, written last."""
    directory = job_dir / step_dir_name(step, micro_step)
    directory.mkdir(parents=True)
    rng = __import__("random").Random(seed * 100_003 + step)
    for rank, size in enumerate(sizes):
        (directory / f"__{rank}_0.distcp").write_bytes(rng.randbytes(size))
    (directory / ".metadata").write_bytes(rng.randbytes(512))
    manifest = Manifest.describe(directory, job=JOB, step=step, micro_step=micro_step, world_size=len(sizes),
                                 spec_hash="abc", version="test", reason="interval")
    write_manifest(directory, manifest)
    return directory


def make_tier(**kwargs) -> GcsTier:
    kwargs.setdefault("retry", FAST)
    kwargs.setdefault("workers", 4)
    return GcsTier(REMOTE, JOB, **kwargs)


def remote_objects(server: GcsServer, step: int, micro_step: int = 0) -> dict[str, Blob]:
    prefix = f"ckpt/run1/{JOB}/{step_dir_name(step, micro_step)}/"
    return {b.name[len(prefix):]: b for b in server.client().list_blobs(BUCKET, prefix=prefix)}


def assert_remote_matches(server: GcsServer, local_step: Path) -> None:
    manifest = read_manifest(local_step)
    objects = remote_objects(server, manifest.step, manifest.micro_step)
    assert set(objects) == {e.path for e in manifest.files} | {MANIFEST}
    for entry in manifest.files:
        assert (objects[entry.path].size, objects[entry.path].crc32c) == (entry.size, entry.crc32c), entry.path
        assert objects[entry.path].download_as_bytes() == (local_step / entry.path).read_bytes()
    assert objects[MANIFEST].download_as_bytes() == (local_step / MANIFEST).read_bytes()
    # The commit marker was created after every data object.
    assert objects[MANIFEST].generation > max(objects[e.path].generation for e in manifest.files)


def test_upload_after_commit(gcs_server, tmp_path):
    step_dir = make_step(tmp_path / "local" / JOB, 100)
    tier = make_tier()
    transfer = tier.upload_step(step_dir)
    assert transfer.name == "step_000000100" and transfer.files == 5
    assert transfer.bytes == read_manifest(step_dir).total_bytes
    assert_remote_matches(gcs_server, step_dir)
    [remote] = tier.committed_steps()
    assert remote.step == 100 and remote.complete and remote.manifest == read_manifest(step_dir)
    assert remote.url == f"{REMOTE}/{JOB}/step_000000100/"
    # A second upload of the same step finds it committed and moves nothing.
    again = tier.upload_step(step_dir)
    assert again.bytes == 0 and again.skipped_bytes == transfer.bytes


def test_uncommitted_local_dir_is_not_uploaded(gcs_server, tmp_path):
    step_dir = make_step(tmp_path / JOB, 7)
    (step_dir / MANIFEST).unlink()
    with pytest.raises(Exception, match="not a committed step"):
        make_tier().upload_step(step_dir)
    assert remote_objects(gcs_server, 7) == {}


@pytest.mark.slow
def test_upload_completes_across_a_server_restart_and_commits_last(gcs_server, tmp_path, monkeypatch):
    step_dir = make_step(tmp_path / JOB, 300, sizes=(400_000,) * 10 + (9 << 20,))  # > 8 MiB: resumable
    data_paths = {e.path for e in read_manifest(step_dir).files}
    remote_dir = gcs_server.root / BUCKET / "ckpt/run1" / JOB / step_dir_name(300)
    events: list[tuple[str, str]] = []  # ("done", name) per finished upload call, ("stop"/"start", "")
    manifest_seen_while_down: list[bool] = []
    snapshots: list[set[str]] = []
    lock = threading.Lock()
    original = Blob._handle_filename_and_upload

    def restart_later() -> None:
        time.sleep(1.0)
        gcs_server.start()
        with lock:
            events.append(("start", ""))

    def watched_upload(self, filename, *args, **kwargs):
        result = original(self, filename, *args, **kwargs)
        with lock:
            events.append(("done", self.name.rsplit("/", 1)[-1]))
            finished = sum(1 for kind, _ in events if kind == "done")
            stop_now = finished == 2
            if stop_now:
                events.append(("stop", ""))
        if stop_now:  # two objects are in: pull the plug on the server, bring it back a second later
            gcs_server.stop()
            manifest_seen_while_down.append((remote_dir / MANIFEST).exists())
            threading.Thread(target=restart_later, daemon=True).start()
        return result

    def poll(stop: threading.Event) -> None:  # the server's storage, straight from its filesystem
        while not stop.is_set():
            if remote_dir.is_dir():
                snapshots.append({p.name for p in remote_dir.iterdir()})
            time.sleep(0.005)

    monkeypatch.setattr(Blob, "_handle_filename_and_upload", watched_upload)
    stop_polling = threading.Event()
    poller = threading.Thread(target=poll, args=(stop_polling,), daemon=True)
    poller.start()
    started = time.monotonic()
    try:
        with structlog.testing.capture_logs() as logs:
            transfer = make_tier(workers=2).upload_step(step_dir)
    finally:
        stop_polling.set()
        poller.join()
    elapsed = time.monotonic() - started
    # Requests failed against the stopped server and were retried.
    assert any(entry["event"] == "gcs request failed, retrying" for entry in logs), logs

    kinds = [kind for kind, _ in events]
    assert "stop" in kinds and "start" in kinds, events
    assert elapsed >= 1.0  # it waited through the outage
    assert manifest_seen_while_down == [False]
    # The manifest upload finished last, after the restart and after every data object.
    done = [name for kind, name in events if kind == "done"]
    assert done[-1] == MANIFEST and set(done[:-1]) >= data_paths and MANIFEST not in done[:-1]
    assert kinds.index("start") < len(kinds) - 1
    # No observation of the server's storage ever had the manifest without all the data.
    assert any(s and MANIFEST not in s for s in snapshots)
    for s in snapshots:
        if MANIFEST in s:
            assert data_paths <= s, s
    assert transfer.bytes + transfer.skipped_bytes == read_manifest(step_dir).total_bytes
    assert_remote_matches(gcs_server, step_dir)


def test_a_lost_resumable_upload_session_is_started_anew(gcs_server, tmp_path, monkeypatch):
    """Files over 8 MiB go up in a resumable session; a server that forgets it (404/410 on the
    session URL, e.g. restarted or expired) means: upload that file again, in a new session."""
    step_dir = make_step(tmp_path / JOB, 9, sizes=(9 << 20,))
    original = Blob._initiate_resumable_upload
    sessions = []

    def forgetful_server(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        sessions.append(self.name)
        if len(sessions) == 1:
            gcs_server.restart()  # the session just created is gone
        return result

    monkeypatch.setattr(Blob, "_initiate_resumable_upload", forgetful_server)
    with structlog.testing.capture_logs() as logs:
        make_tier().upload_step(step_dir)
    assert len(sessions) == 2 and sessions[0] == sessions[1]
    assert any(entry["event"] == "gcs upload retrying" for entry in logs)
    assert_remote_matches(gcs_server, step_dir)


def test_transient_failures_are_retried_for_a_bounded_time(gcs_server, tmp_path):
    step_dir = make_step(tmp_path / JOB, 5, sizes=(1000,))
    gcs_server.stop()
    tier = make_tier(retry=RetryPolicy(initial=0.05, maximum=0.2, deadline=1.5, request_timeout=2.0))
    started = time.monotonic()
    with pytest.raises(RemoteUnavailable, match="after 1.5s of retries"):
        tier.upload_step(step_dir)
    assert time.monotonic() - started < 10


def test_fresh_host_downloads_the_newest_remote_step(gcs_server, tmp_path):
    host_a = tmp_path / "a" / JOB
    tier = make_tier()
    for step in (100, 200):
        tier.upload_step(make_step(host_a, step))
    host_b = tmp_path / "b" / JOB
    assert ensure_newest_local(tier, host_b) == host_b / "step_000000200"
    [(step, directory, manifest)] = committed_steps(host_b)
    assert step == 200 and manifest == read_manifest(host_a / step_dir_name(200))
    assert problems(directory, manifest, checksums=True) == []
    for entry in manifest.files:
        assert (directory / entry.path).read_bytes() == (host_a / step_dir_name(200) / entry.path).read_bytes()
    assert sorted(p.name for p in host_b.iterdir()) == [step_dir_name(200)]  # no temp dirs left
    # Local already newest: nothing is downloaded.
    assert ensure_newest_local(tier, host_a) == host_a / "step_000000200"
    # A host with only an older local step gets the newer one.
    host_c = tmp_path / "c" / JOB
    make_step(host_c, 100)
    assert ensure_newest_local(tier, host_c) == host_c / "step_000000200"
    assert [s for s, _, _ in committed_steps(host_c)] == [100, 200]
    # A partial step (2 micro-batches of step 201 accumulated) is newer than step 200.
    tier.upload_step(make_step(host_a, 200, micro_step=2, sizes=(3000,)))
    assert [s.name for s in tier.committed_steps()][-1] == "step_000000200.0002"
    assert ensure_newest_local(tier, host_c) == host_c / "step_000000200.0002"
    assert read_manifest(host_c / "step_000000200.0002").micro_step == 2


def test_a_damaged_local_newest_is_replaced_by_the_remote_copy(gcs_server, tmp_path):
    tier = make_tier()
    tier.upload_step(make_step(tmp_path / "a" / JOB, 100))
    host_b = tmp_path / "b" / JOB
    broken = make_step(host_b, 100)
    (broken / "__0_0.distcp").unlink()
    assert ensure_newest_local(tier, host_b) == broken
    [(_, directory, manifest)] = committed_steps(host_b)
    assert problems(directory, manifest, checksums=True) == []


def test_corrupted_remote_object_fails_the_download_without_committing(gcs_server, tmp_path):
    step_dir = make_step(tmp_path / "a" / JOB, 100)
    tier = make_tier()
    tier.upload_step(step_dir)
    # Someone rewrites one object behind our back: same name and size, other bytes.
    blob = gcs_server.client().bucket(BUCKET).blob(f"ckpt/run1/{JOB}/{step_dir_name(100)}/__1_0.distcp")
    blob.upload_from_string(os.urandom(1 << 20))
    fresh = tmp_path / "b" / JOB
    with pytest.raises(RemoteCorrupt, match="__1_0.distcp.*CRC32C"):
        tier.download_step(100, fresh)
    assert committed_steps(fresh) == []
    assert list(fresh.iterdir()) == []  # the temporary directory is gone too
    # The listing sees it as well: the step is committed but not complete, so no resume from it.
    [remote] = tier.committed_steps()
    assert not remote.complete and "__1_0.distcp" in remote.problems[0]


def test_a_second_writer_cannot_overwrite_a_committed_object(gcs_server, tmp_path, monkeypatch):
    first = make_step(tmp_path / "a" / JOB, 100, seed=1)
    second = make_step(tmp_path / "b" / JOB, 100, seed=2)  # same names, other bytes
    tier = make_tier()
    tier.upload_step(first)
    before = {name: (b.generation, b.crc32c) for name, b in remote_objects(gcs_server, 100).items()}

    with pytest.raises(RemoteConflict, match="not overwriting"):
        tier.upload_step(second)  # the remote manifest says: another step 100 is committed
    # Half-finished upload by the first writer (no manifest), second writer arrives:
    gcs_server.client().bucket(BUCKET).blob(f"ckpt/run1/{JOB}/{step_dir_name(100)}/{MANIFEST}").delete()
    with pytest.raises(RemoteConflict, match="already exists with .* CRC32C"):
        tier.upload_step(second)
    # And with the pre-upload listing skipped, the server's if_generation_match=0 check alone
    # must refuse the write (412), and the 412 must be judged by CRC32C.
    monkeypatch.setattr(GcsTier, "_list", lambda self, prefix, until: {})
    with pytest.raises(RemoteConflict, match="already exists with .* CRC32C"):
        tier.upload_step(second)
    after = {name: (b.generation, b.crc32c) for name, b in remote_objects(gcs_server, 100).items()}
    assert after == {k: v for k, v in before.items() if k != MANIFEST}  # untouched, still no manifest
    # The first writer's retry (same bytes) meets 412 on every object, finds equal CRC32C, commits.
    transfer = tier.upload_step(first)
    assert transfer.bytes == 0 and transfer.skipped_bytes == read_manifest(first).total_bytes
    monkeypatch.undo()
    assert_remote_matches(gcs_server, first)


def test_remote_retention_keeps_the_newest_steps(gcs_server, tmp_path):
    local = tmp_path / JOB
    tier = make_tier()
    for step in (10, 20, 30, 40, 50):
        tier.upload_step(make_step(local, step, sizes=(2000, 100)))
    # Leftovers of an interrupted upload, older and newer than what is kept.
    bucket = gcs_server.client().bucket(BUCKET)
    bucket.blob(f"ckpt/run1/{JOB}/{step_dir_name(5)}/__0_0.distcp").upload_from_string(b"x")
    bucket.blob(f"ckpt/run1/{JOB}/{step_dir_name(60)}/__0_0.distcp").upload_from_string(b"y")

    assert tier.apply_retention(keep=2) == [step_dir_name(s) for s in (5, 10, 20, 30)]
    assert [s.step for s in tier.committed_steps()] == [40, 50]
    for step in (5, 10, 20, 30):
        assert remote_objects(gcs_server, step) == {}
    assert set(remote_objects(gcs_server, 60)) == {"__0_0.distcp"}  # maybe an upload in progress: kept
    assert_remote_matches(gcs_server, local / step_dir_name(50))
    # keep never drops below one: the newest committed step is never deleted.
    assert tier.apply_retention(keep=0) == [step_dir_name(40)]
    assert [s.step for s in tier.committed_steps()] == [50]
    assert tier.apply_retention(keep=3) == []


def test_retention_deletes_the_manifest_first(gcs_server, tmp_path, monkeypatch):
    local = tmp_path / JOB
    tier = make_tier()
    for step in (1, 2):
        tier.upload_step(make_step(local, step, sizes=(100, 100)))
    deleted: list[str] = []
    original = Blob.delete

    def recording_delete(self, *args, **kwargs):
        deleted.append(self.name.rsplit("/", 1)[-1])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Blob, "delete", recording_delete)
    assert tier.apply_retention(keep=1) == [step_dir_name(1)]
    assert deleted[0] == MANIFEST and len(deleted) == 4


def test_uploader_uploads_in_the_background_and_applies_retention(gcs_server, tmp_path):
    local = tmp_path / JOB
    uploader = Uploader(make_tier(), local, keep=2).start()
    try:
        for step in (1, 2, 3):
            uploader.submit(make_step(local, step, sizes=(5000,)))
            assert uploader.wait(timeout=30)
        stats = uploader.stats
        assert (stats.uploaded, stats.failures, stats.last) == (3, 0, "step_000000003")
        assert [s.step for s in make_tier().committed_steps()] == [2, 3]
        assert uploader.protected_steps() == frozenset()
    finally:
        assert uploader.close(timeout=10)


def test_uploader_newest_wins_and_protects_what_it_holds(gcs_server, tmp_path, monkeypatch):
    local = tmp_path / JOB
    tier = make_tier()
    gate, entered = threading.Event(), threading.Event()
    uploaded: list[int] = []
    real_upload = GcsTier.upload_step

    def slow_upload(self, step_dir):
        entered.set()
        gate.wait(30)
        result = real_upload(self, step_dir)
        uploaded.append(result.name)
        return result

    monkeypatch.setattr(GcsTier, "upload_step", slow_upload)
    uploader = Uploader(tier, local, keep=5).start()
    try:
        uploader.submit(make_step(local, 1, sizes=(100,)))
        assert entered.wait(10)
        for step in (2, 3, 4):
            uploader.submit(make_step(local, step, sizes=(100,)))
        uploader.submit(local / step_dir_name(2))  # older than the queued one: ignored
        assert uploader.protected_steps() == {1, 4}
        assert uploader.is_protected(4) and not uploader.is_protected(2)
        assert pinned_steps(local) == {1, 4}  # what the worker's local retention reads
        assert not uploader.wait(timeout=0.2)
        gate.set()
        assert uploader.wait(timeout=30)
        assert uploaded == ["step_000000001", "step_000000004"]
        assert [s.step for s in tier.committed_steps()] == [1, 4]
        assert uploader.protected_steps() == frozenset() and pinned_steps(local) == set()
    finally:
        gate.set()
        uploader.close(timeout=10)


def test_uploader_keeps_its_interval_but_uploads_urgent_steps_at_once(gcs_server, tmp_path, monkeypatch):
    """remote_interval_seconds: an upload begins at most once per interval, with the newest step
    committed by then; a final, requested or preemption save (urgent), and the stop path's wait(),
    upload at once."""
    local, tier = tmp_path / JOB, make_tier()
    began: dict[str, float] = {}
    real_upload = GcsTier.upload_step

    def timed_upload(self, step_dir):
        began[Path(step_dir).name] = time.monotonic()
        return real_upload(self, step_dir)

    monkeypatch.setattr(GcsTier, "upload_step", timed_upload)
    uploader = Uploader(tier, local, keep=5, interval=1.0).start()
    try:
        uploader.submit(make_step(local, 1, sizes=(100,)))  # the first: at once
        assert uploader.wait(timeout=10) and list(began) == ["step_000000001"]
        uploader.interval = 1.5
        for step in (2, 3):
            uploader.submit(make_step(local, step, sizes=(100,)))
        deadline = time.monotonic() + 10
        while "step_000000003" not in began and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list(began) == ["step_000000001", "step_000000003"]  # 2 was superseded while 3 waited
        # began[] is read a little after the uploader's own start time, by a varying amount (once in
        # CI the first read came later than the second: 1.49999 s): a tenth of a second of slack.
        assert began["step_000000003"] - began["step_000000001"] >= 1.5 - 0.1
        uploader.interval = 60.0
        uploader.submit(make_step(local, 4, sizes=(100,)), urgent=True)
        deadline = time.monotonic() + 10
        while "step_000000004" not in began and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "step_000000004" in began and began["step_000000004"] - began["step_000000003"] < 10
        uploader.submit(make_step(local, 5, sizes=(100,)))
        assert uploader.stats.queued == "step_000000005"
        assert uploader.wait(timeout=10)  # the stop path does not wait for the interval
        assert [s.step for s in tier.committed_steps()] == [1, 3, 4, 5]
    finally:
        uploader.close(timeout=10)


def test_an_auto_interval_learns_what_an_upload_takes(gcs_server, tmp_path):
    local = tmp_path / JOB
    policy = SecondsPolicy(3600.0, max_seconds=600.0, max_overhead=0.05)
    results = []
    uploader = Uploader(make_tier(), local, keep=3, interval=policy, on_result=lambda key, t: results.append(t)).start()
    try:
        assert uploader.policy().seconds == 0
        uploader.submit(make_step(local, 1, sizes=(100,)))
        assert uploader.wait(timeout=10)
        interval = uploader.policy()
        assert interval.save_seconds == results[0].seconds > 0
        assert interval.seconds == pytest.approx(young_seconds(results[0].seconds, 3600.0, 0.05))
        uploader.submit(make_step(local, 2, sizes=(100,)))
        assert uploader.stats.queued == "step_000000002"  # waits out the interval it learned
    finally:
        uploader.close(timeout=10)


@pytest.mark.slow
def test_uploader_survives_failures_and_retries_later(gcs_server, tmp_path):
    local = tmp_path / JOB
    tier = make_tier(retry=RetryPolicy(initial=0.05, maximum=0.2, deadline=0.5, request_timeout=2.0))
    uploader = Uploader(tier, local, keep=3, retry_initial=0.2, retry_maximum=0.5).start()
    try:
        gcs_server.stop()
        uploader.submit(make_step(local, 1, sizes=(1000,)))
        deadline = time.monotonic() + 20
        while uploader.stats.failures < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = uploader.stats
        assert stats.failures >= 2 and stats.uploaded == 0 and "step_000000001" in stats.last_error
        assert uploader.is_protected(1) and pinned_steps(local) == {1}  # still held for a retry
        gcs_server.start()
        assert uploader.wait(timeout=30)
        assert uploader.stats.uploaded == 1 and uploader.stats.last_error is None
        assert [s.step for s in tier.committed_steps()] == [1]
    finally:
        uploader.close(timeout=10)


def test_uploader_gives_up_on_a_conflict_and_goes_on(gcs_server, tmp_path):
    tier = make_tier()
    tier.upload_step(make_step(tmp_path / "a" / JOB, 1, seed=1))
    local = tmp_path / "b" / JOB
    uploader = Uploader(tier, local, keep=3, retry_initial=0.1).start()
    try:
        uploader.submit(make_step(local, 1, seed=2))
        assert uploader.wait(timeout=30)
        assert uploader.stats.failures == 1 and "not overwriting" in uploader.stats.last_error
        uploader.submit(make_step(local, 2, seed=2))
        assert uploader.wait(timeout=30)
        assert uploader.stats.uploaded == 1
        assert [s.step for s in tier.committed_steps()] == [1, 2]
    finally:
        uploader.close(timeout=10)


def test_manifest_crc_is_what_gcs_reports(gcs_server, tmp_path):
    data = tmp_path / "f.bin"
    data.write_bytes(os.urandom(12345))
    blob = gcs_server.client().bucket(BUCKET).blob("probe/f.bin")
    blob.upload_from_filename(str(data))
    assert blob.crc32c == file_crc32c(data)


def test_uploader_clears_stale_pins_and_unpins_on_close(gcs_server, tmp_path):
    local = tmp_path / JOB
    pin(local, 7)  # left by a supervisor that crashed mid-upload
    uploader = Uploader(make_tier(), local, keep=3).start()
    assert pinned_steps(local) == set()
    uploader.submit(make_step(local, 8, sizes=(100,)))
    assert uploader.close(timeout=30)
    assert pinned_steps(local) == set() and uploader.stats.last == "step_000000008"


@pytest.mark.slow  # the failed attempt waits out the client's retries
def test_uploader_reports_each_attempt(gcs_server, tmp_path, monkeypatch):
    local = tmp_path / "local" / JOB
    results = []
    # An attempt gives up after 2 s of refused connections (FAST: 30 s), so that the failure comes soon.
    tier = make_tier(retry=RetryPolicy(initial=0.05, maximum=0.2, deadline=2.0, request_timeout=2.0))
    uploader = Uploader(tier, local, keep=3, retry_initial=0.1, retry_maximum=0.2,
                        on_result=lambda key, transfer: results.append((key, transfer))).start()
    uploader.submit(make_step(local, 4))
    assert uploader.wait(60)
    assert results[0][0] == (4, 0) and results[0][1].bytes > 0
    gcs_server.stop()  # the next attempt fails: reported with no transfer
    uploader.submit(make_step(local, 8, seed=1))
    deadline = time.monotonic() + 30
    while not any(t is None for _, t in results) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ((8, 0), None) in results
    gcs_server.restart()
    uploader.close(timeout=60)
