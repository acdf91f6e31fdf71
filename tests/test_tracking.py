"""tpud.tracking: one wandb run per job across restarts, with real wandb in offline mode (no mocks).

What wandb wrote is read back from its transaction logs (run-<id>.wandb). wandb 0.31 no longer ships
a Python reader for them (the old wandb.sdk.internal.datastore went with the Python backend; the Go
wandb-core writes them), so read_wandb_file() below decodes the container, leveldb's log format with
wandb's 7-byte file header, and parses each record with wandb's own protobuf, wandb_internal_pb2.Record.
"""

from __future__ import annotations

import socket
import struct
import subprocess
import time
import zlib
from pathlib import Path

import pytest
import structlog

from engine.spec.schema import WandbConfig
from tests.conftest import PYTHON, REPO, python_env
from tpud.tracking import WandbRun, new_run_id

BLOCK = 32768                      # leveldb log block size
FILE_HEADER = b":W&B\xe1\xbe\x00"  # ident ":W&B", magic 0xBEE1 (little-endian), version 0
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_wandb_file(path: Path) -> list:
    """The records of one .wandb transaction log, in write order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:len(FILE_HEADER)] == FILE_HEADER, path
    records, pending, pos = [], b"", len(FILE_HEADER)
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if (crc, length, kind) == (0, 0, 0):  # zero padding up to the block's end
            pos += BLOCK - pos % BLOCK
            continue
        if pos + 7 + length > len(data):
            break  # a record still being written
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        # wandb's checksum: plain CRC-32 of the type byte, then the data.
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"{path}: bad checksum at {pos}"
        pending += chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def history_rows(records: list) -> list[dict]:
    import json

    return [{".".join(item.nested_key) or item.key: json.loads(item.value_json) for item in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]


def offline_runs(directory: Path, timeout: float = 20.0) -> list[tuple[str, list]]:
    """(run id, records) of each offline run directory under `directory`, oldest first. The 'latest-run'
    symlink is skipped: only the offline-run-* directories themselves count. wandb's service process
    may still be writing a file after finish() returned, so a file is read until its run's exit record
    is there."""
    runs = []
    for run_dir in sorted((directory / "wandb").glob("offline-run-*")):
        files = list(run_dir.glob("run-*.wandb"))
        assert len(files) == 1, files
        deadline = time.monotonic() + timeout
        while True:
            records = read_wandb_file(files[0])
            kinds = [r.WhichOneof("record_type") for r in records]
            if "exit" in kinds or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        runs.append((run.start_time.ToNanoseconds(), run.run_id, records))
    return [(run_id, records) for _, run_id, records in sorted(runs, key=lambda t: t[0])]


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """Keep wandb's files inside tmp_path; a fresh wandb singleton per test, since wandb reads its
    environment once, at the first setup in a process."""
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        path = tmp_path / name.lower()
        path.mkdir()
        monkeypatch.setenv(name, str(path))
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    yield tmp_path
    import wandb

    wandb.teardown()


def offline(**overrides) -> WandbConfig:
    return WandbConfig(project="tpud-test", mode="offline", **overrides)


def test_new_run_id():
    ids = {new_run_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(len(i) == 8 and i.isascii() and i.isalnum() and i == i.lower() for i in ids)


def test_one_run_whose_history_spans_a_restart(wandb_env):
    """The run directory holds one run whose history spans a daemon restart and a rollback."""
    run_id, directory = new_run_id(), wandb_env / "job"  # wandb adds wandb/ below it
    loss = {s: 10.0 / s for s in range(1, 8)}

    first = WandbRun(offline(tags=["t"]), job="demo", run_id=run_id, directory=directory, config={"lr": 0.1})
    for step in range(1, 6):
        first.log({"loss": loss[step], "grad_norm": 1.5, "lr": 0.1, "mfu": None, "rss_bytes": 123}, step)
    assert first.last_step == 5
    first.close(timeout=30)

    # The daemon restarts (a new WandbRun, same id, last_step from job.json); the worker resumed from
    # the step-2 checkpoint, so the engine's steps go back to 3.
    second = WandbRun(offline(), job="demo", run_id=run_id, directory=directory, config={"lr": 0.1},
                      last_step=first.last_step)
    for step in range(3, 8):
        second.log({"loss": loss[step], "grad_norm": 1.5, "lr": 0.1}, step)
    assert second.last_step == 10
    second.close(timeout=30)

    # wandb 0.31 offline writes each init into its own directory, offline-run-<time>-<id>
    # (suffixed -1, -2 when two start within the same second); `wandb sync` uploads them in
    # order into the one run. Order them by the run record's start time.
    runs = offline_runs(directory)
    assert len(runs) == 2
    assert {run_id for run_id, _ in runs} == {run_id}
    rows = [row for _, records in runs for row in history_rows(records)]
    assert [row["_step"] for row in rows] == list(range(1, 11))  # strictly increasing across both
    assert [row["train/step"] for row in rows] == [1, 2, 3, 4, 5, 3, 4, 5, 6, 7]
    assert [row["train/loss"] for row in rows] == [loss[s] for s in (1, 2, 3, 4, 5, 3, 4, 5, 6, 7)]
    assert all(row["train/grad_norm"] == 1.5 and row["train/lr"] == 0.1 for row in rows)
    assert [row.get("memory/host_rss_bytes") for row in rows] == [123] * 5 + [None] * 5
    assert not any("perf/mfu" in row for row in rows)  # None is skipped
    for _, records in runs:  # every init makes train/step the x-axis of the train/ perf/ memory/ charts
        metrics = {r.metric.glob_name or r.metric.name: r.metric.step_metric
                   for r in records if r.WhichOneof("record_type") == "metric"}
        assert metrics.get("train/*") == "train/step", metrics


def test_two_jobs_log_to_their_own_runs(wandb_env):
    """Two jobs' runs alive at once in one process, each logging to its own run id."""
    ids = {"a": new_run_id(), "b": new_run_id()}
    runs = {job: WandbRun(offline(), job=job, run_id=ids[job], directory=wandb_env / job, config={"job": job})
            for job in ids}
    for step in range(1, 6):
        runs["a"].log({"loss": float(step)}, step)
        runs["b"].log({"loss": -float(step)}, step)
    # Job b's worker restarts from its step-1 checkpoint while the daemon (this WandbRun) lives on.
    for step in (2, 3):
        runs["b"].log({"loss": -float(step)}, step)
    for run in runs.values():
        run.close(timeout=30)
    expected = {"a": [1, 2, 3, 4, 5], "b": [1, 2, 3, 4, 5, 2, 3]}
    for job, sign in (("a", 1), ("b", -1)):
        [(run_id, records)] = offline_runs(wandb_env / job)
        assert run_id == ids[job]
        rows = history_rows(records)
        assert [row["train/step"] for row in rows] == expected[job]
        assert [row["_step"] for row in rows] == list(range(1, len(expected[job]) + 1))
        assert [row["train/loss"] for row in rows] == [sign * float(s) for s in expected[job]]
    assert runs["b"].last_step == 7


def test_daemon_side_never_imports_torch(wandb_env):
    script = f"""
import sys
from pathlib import Path
from engine.spec.schema import WandbConfig
from tpud.tracking import WandbRun, new_run_id
run = WandbRun(WandbConfig(project="p", mode="offline"), job="j", run_id=new_run_id(),
               directory=Path({str(wandb_env / "job")!r}), config={{}})
run.log({{"loss": 1.0, "tokens_per_s": 5.0}}, 1)
run.close(timeout=30)
assert "wandb" in sys.modules, "the run did not start"
assert "torch" not in sys.modules, "the daemon side imported torch"
print("ok")
"""
    result = subprocess.run([PYTHON, "-c", script], cwd=REPO, env=python_env(), capture_output=True, text=True,
                            timeout=120)
    # structlog's default configuration prints the run's log lines to stdout before "ok".
    assert result.returncode == 0 and result.stdout.splitlines()[-1:] == ["ok"], result.stdout + result.stderr
    assert list((wandb_env / "job" / "wandb").glob("offline-run-*/run-*.wandb"))


def test_log_never_blocks_on_a_stuck_init(wandb_env, monkeypatch):
    """Online, with the server unreachable: init hangs until its timeout, then fails. log() returns at
    once all along, close() returns within its timeout, and nothing is raised."""
    with socket.socket() as s:  # a local port with nothing listening: connections are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)  # well-formed, so init gets as far as the network
    with structlog.testing.capture_logs() as logs:
        run = WandbRun(WandbConfig(project="p", mode="online"), job="j", run_id=new_run_id(),
                       directory=wandb_env / "job", config={}, init_timeout=3.0)
        start = time.monotonic()
        for step in range(1, 101):
            run.log({"loss": 1.0}, step)
        assert time.monotonic() - start < 0.5
        assert run.last_step == 100

        start = time.monotonic()
        run.close(timeout=1.0)  # init is still trying
        assert time.monotonic() - start < 2.0
        run.close(timeout=30)  # waits again, for the failed init and the thread's end
        assert not run._thread.is_alive()
    assert any(e["event"].startswith("wandb init failed") for e in logs), logs
    run.log({"loss": 1.0}, 101)  # after close: ignored, never raises


def test_eval_loss_is_logged_as_eval_loss_against_the_engine_step(wandb_env):
    from engine import events
    from tpud.tracking import JobTracker

    tracker = JobTracker(offline(), job="demo", directory=wandb_env / "job", saved={}, newest_run_id=lambda: None)
    tracker.log(events.Step(step=4, loss=3.0, grad_norm=1.0, lr=0.1, tokens_per_s=1.0, step_time_s=0.1), dict)
    tracker.log_eval(events.Eval(step=4, loss=2.5, perplexity=12.18, seconds=0.3))
    tracker.run.close(timeout=30)
    [(_, records)] = offline_runs(wandb_env / "job")
    rows = history_rows(records)
    assert rows[-1]["eval/loss"] == 2.5 and rows[-1]["eval/perplexity"] == 12.18 and rows[-1]["train/step"] == 4
    metrics = {r.metric.glob_name or r.metric.name: r.metric.step_metric
               for r in records if r.WhichOneof("record_type") == "metric"}
    assert metrics.get("eval/*") == "train/step"


# --- TensorBoard (tpud/tensorboard_log.py), read back with TensorBoard's own reader ---


def read_board(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """Each tag's (step, value) as TensorBoard shows them: its reader, purging what a restart left behind."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(directory))
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def test_tensorboard_forgets_what_a_restart_trains_again_and_a_gs_directory_is_uploaded(tmp_path, gcs_server):
    from tpud.tensorboard_log import TensorBoardLog

    for directory in (str(tmp_path / "runs"), "gs://tpud-test/boards"):
        board = TensorBoardLog(directory, "job", tmp_path / "staging" / directory[-5:])
        board.begins_at(0)
        for step in range(1, 9):  # steps 7 and 8 are lost in a crash: the state restored is step 6's
            board.scalars({"train/loss": 10.0 - step, "perf/tokens_per_s": 100.0}, step)
        board.begins_at(6)
        for step in range(7, 11):
            board.scalars({"train/loss": 100.0 + step}, step)
        board.close()
        if directory.startswith("gs://"):
            local = tmp_path / "downloaded"
            local.mkdir()
            for blob in gcs_server.client().list_blobs("tpud-test", prefix="boards/job/"):
                blob.download_to_filename(local / blob.name.rsplit("/", 1)[1])
        else:
            local = tmp_path / "runs" / "job"
        shown = read_board(local)
        assert shown["train/loss"] == [(s, 10.0 - s) for s in range(1, 7)] + [(s, 100.0 + s) for s in range(7, 11)]
        assert [s for s, _ in shown["perf/tokens_per_s"]] == [1, 2, 3, 4, 5, 6]


def test_the_first_hosts_tracker_logs_each_step_with_goodput_and_eval_and_restarts_the_curve(tmp_path):
    from engine import events
    from tpud.tracking import JobTracker

    goodput = {"ratio": 0.75, "badput_seconds": {"startup": 3.0, "lost": 1.5}}
    tracker = JobTracker(None, job="job", directory=tmp_path / "state", saved={}, newest_run_id=lambda: None,
                         tensorboard=str(tmp_path / "runs"), goodput=lambda: goodput)
    quiet = JobTracker(None, job="job", directory=tmp_path / "state1", saved={}, newest_run_id=lambda: None,
                       tensorboard=str(tmp_path / "runs1"), goodput=lambda: goodput)
    quiet.on_gang(events.Gang(host=1, hosts=2, present=2, generation=0, members=[0, 1]))  # not the first member
    for t in (tracker, quiet):
        t.on_started(events.Started(step=0))
        for step in (1, 2, 3):
            t.on_step(events.Step(step=step, loss=2.0 / step, grad_norm=1.0, lr=1e-3, tokens_per_s=50.0,
                                  step_time_s=0.1, mfu=None, distill_divergence=1.0 / step, distill_ce=3.0))
        t.on_eval(events.Eval(step=3, loss=1.25, perplexity=3.49, seconds=0.2))
        t.on_rolled_back(events.RolledBack(step=3, kind="spike", reason="", restored_step=2, verdict="data", skip=None,
                                           samples=None, redone_steps=1, seconds=0.1))
        t.on_step(events.Step(step=3, loss=0.5, grad_norm=1.0, lr=1e-3, tokens_per_s=50.0, step_time_s=0.1))
        t.close(10)
    shown = read_board(tmp_path / "runs" / "job")
    assert shown["train/loss"] == [(1, 2.0), (2, 1.0), (3, 0.5)]  # step 3 trained again after the rollback
    assert {"train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/step_time_s", "goodput/ratio",
            "goodput/badput_startup_seconds", "goodput/badput_lost_seconds", "eval/loss", "eval/perplexity",
            "distill/divergence", "distill/hard_ce"} <= set(shown)
    assert "perf/mfu" not in shown  # no value (CPU without a peak): nothing logged, not a zero
    assert shown["goodput/ratio"][0] == (1, 0.75)
    assert not (tmp_path / "runs1").exists()


def test_a_job_file_that_moves_its_tensorboard_directory_logs_there_from_the_next_step(tmp_path):
    from engine import events
    from tpud.tracking import JobTracker

    tracker = JobTracker(None, job="job", directory=tmp_path / "state", saved={}, newest_run_id=lambda: None,
                         tensorboard=str(tmp_path / "before"))
    step = lambda n: events.Step(step=n, loss=1.0 / n, grad_norm=1.0, lr=1e-3, tokens_per_s=5.0, step_time_s=0.1)  # noqa: E731
    tracker.on_step(step(1))
    before = tracker.board
    tracker.adopt(None, str(tmp_path / "after"))  # the old directory's writer finishes in the background
    tracker.on_step(step(2))
    tracker.close(10)
    before._thread.join(10)
    assert [s for s, _ in read_board(tmp_path / "before" / "job")["train/loss"]] == [1]
    assert [s for s, _ in read_board(tmp_path / "after" / "job")["train/loss"]] == [2]
