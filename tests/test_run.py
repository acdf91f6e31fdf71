"""`tpud run` end to end: real supervisor and worker processes, real signals."""

import json
import os
import signal
import subprocess
import time

import pytest

from engine import exit_codes
from tests.conftest import PYTHON, TINY_JOB, python_env
from testkit.helpers import read_records

pytestmark = pytest.mark.slow
QUICK = ["data.corpus_bytes=400000", "data.micro_batch_size=4", "data.seq_len=64", "scheduler.warmup_steps=1",
         "train.log_interval=1"]


def tpud_run(home, *overrides, job=TINY_JOB):
    # Overrides on both sides of an option, as people type them.
    return subprocess.Popen([PYTHON, "-m", "tpud", "run", str(job), *QUICK, "--home", str(home), *overrides],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=python_env())


def read_until(proc, event, timeout=120):
    """JSON log records from proc's stdout up to and including the first `event`."""
    return read_records(proc, lambda record: record["event"] == event, timeout)


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_run_trains_to_max_steps_and_exits_0(tmp_path):
    proc = tpud_run(tmp_path, "train.max_steps=5")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == exit_codes.OK, err
    records = [json.loads(line) for line in out.splitlines()]
    steps = [r["step"] for r in records if r["event"] == "step"]
    assert steps == [1, 2, 3, 4, 5]
    exited = next(r for r in records if r["event"] == "worker exited")
    assert exited["status"] == 0 and {"job": "tiny-cpu", "state": "SUCCEEDED"}.items() <= next(
        r for r in records if r["event"] == "job state" and r["state"] == "SUCCEEDED").items()
    assert all(r["job"] == "tiny-cpu" for r in records if r["event"] == "step")
    spec = json.loads((tmp_path / "state" / "jobs" / "tiny-cpu" / "spec.json").read_text())
    assert spec["train"]["max_steps"] == 5  # the worker trained the validated, overridden spec


def test_sigterm_checkpoints_then_stops_with_exit_75(tmp_path):
    proc = tpud_run(tmp_path, "train.max_steps=100000")
    worker = read_until(proc, "worker started")[-1]["pid"]
    read_until(proc, "step")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == exit_codes.STOPPED
    events = [json.loads(line)["event"] for line in out.splitlines()]
    assert events.index("checkpoint committed") < events.index("checkpointed, stopping on request")
    assert any(p.name.startswith("step_") for p in (tmp_path / "state" / "checkpoints" / "tiny-cpu").iterdir())
    assert not alive(worker)


def test_a_killed_worker_is_restarted_and_resumes_and_its_tensorboard_curves_go_on_without_going_back(tmp_path):
    proc = tpud_run(tmp_path, "train.max_steps=100000", "checkpoint.interval_steps=3", "checkpoint.memory=null",
                    f"logging.tensorboard={tmp_path / 'runs'}")
    worker = read_until(proc, "worker started")[-1]["pid"]
    committed = read_until(proc, "checkpoint committed")[-1]["step"]
    # Two steps past the commit: the restart trains them again, and logs them again.
    read_records(proc, lambda r: r["event"] == "step" and r["step"] >= committed + 2)
    os.kill(worker, signal.SIGKILL)
    backoff = next(r for r in read_until(proc, "job state") if r["event"] == "job state")
    assert backoff["state"] == "BACKOFF" and backoff["reason"].startswith("killed")
    restarted = read_until(proc, "checkpoint restored")[-1]
    assert restarted["step"] >= 3  # resumed from the checkpoint, not from zero
    read_records(proc, lambda r: r["event"] == "step" and r["step"] >= committed + 4)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == exit_codes.STOPPED

    from tests.test_tracking import read_board

    shown = read_board(tmp_path / "runs" / "tiny-cpu")
    assert {"train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/step_time_s",
            "memory/host_rss_bytes", "goodput/ratio", "goodput/badput_startup_seconds"} <= set(shown)
    steps = [step for step, _ in shown["train/loss"]]
    assert steps == list(range(1, len(steps) + 1)) and steps[-1] >= committed + 4  # each step once, in order
    assert len(list((tmp_path / "runs" / "tiny-cpu").glob("events.out.tfevents.*"))) == 2  # a file a worker


def test_worker_dies_with_a_killed_supervisor(tmp_path):
    proc = tpud_run(tmp_path, "train.max_steps=100000")
    worker = read_until(proc, "worker started")[-1]["pid"]
    read_until(proc, "step")
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(worker), "worker orphaned"


def test_invalid_job_exits_78_naming_file_line_and_key(tmp_path):
    job = tmp_path / "bad.yaml"
    job.write_text("name: bad\ntrain:\n  max_steps: ten\n")
    proc = tpud_run(tmp_path, job=job)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == exit_codes.BAD_INPUT
    assert f"{job}:3: train.max_steps:" in err


def test_fault_injection_is_refused_unless_the_settings_allow_it(tmp_path):
    job = tmp_path / "drill.yaml"
    job.write_text(f"name: drill\ninclude: {TINY_JOB}\ndebug:\n  inject: {{crash_at_step: 3}}\n")
    proc = tpud_run(tmp_path, job=job)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == exit_codes.BAD_INPUT
    assert f"{job}:4: debug.inject: fault injection is refused" in err


def test_kernel_the_backend_lacks_exits_78(tmp_path):
    proc = tpud_run(tmp_path, "attention.kernel=splash")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == exit_codes.BAD_INPUT
    error = next(json.loads(line) for line in out.splitlines() if "job cannot run here" in line)
    assert error["key"] == "attention.kernel" and "TPU" in error["error"]


def test_run_uploads_each_commit_and_a_fresh_host_resumes_from_gcs(tmp_path, gcs_server):
    remote = ["checkpoint.remote=gs://tpud-test/runs", "checkpoint.interval_steps=4"]
    first = tpud_run(tmp_path / "host-a", "train.max_steps=8", *remote)
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    objects = {b.name for b in gcs_server.client().list_blobs("tpud-test", prefix="runs/tiny-cpu/")}
    assert {"runs/tiny-cpu/step_000000004/manifest.json", "runs/tiny-cpu/step_000000008/manifest.json"} <= objects
    # A fresh host with an empty state directory continues from GCS, not from zero.
    second = tpud_run(tmp_path / "host-b", "train.max_steps=10", *remote)
    out, err = second.communicate(timeout=300)
    assert second.returncode == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    restored = next(r for r in records if r["event"] == "checkpoint restored")
    assert restored["step"] == 8 and restored["path"].startswith(str(tmp_path / "host-b"))
    assert [r["step"] for r in records if r["event"] == "step"] == [9, 10]


def test_run_trains_on_a_gs_dataset_fetched_by_the_supervisor_and_reports_eval_loss(tmp_path, gcs_server):
    from engine.prepare.pipeline import prepare
    from engine.prepare.options import Options
    from testkit import corpus

    texts = corpus.docstrings(200)
    source = corpus.write(tmp_path / "docs.jsonl", texts, "jsonl")
    prepare(Options(inputs=(str(source),), tokenizer="bytes", out="gs://tpud-test/data/docs", val_fraction=0.1,
                    workers=1, work_dir=str(tmp_path / "work"), progress=False))
    proc = tpud_run(tmp_path / "home", "train.max_steps=4", "data.dataset=gs://tpud-test/data/docs",
                    "model.vocab_size=264", "eval={interval_steps: 2, batches: 2}")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    fetched = [r for r in records if r["event"] == "downloading dataset"]
    assert len(fetched) == 1 and fetched[0]["to"].startswith(str(tmp_path / "home" / "state" / "datasets"))
    evals = [r for r in records if r["event"] == "eval"]
    assert [r["step"] for r in evals] == [2, 4] and evals[-1]["eval_loss"] < evals[0]["eval_loss"] + 0.5
    ready = next(r for r in records if r["event"] == "trainer ready")
    assert ready["datasets"][0].startswith(str(tmp_path / "home" / "state" / "datasets"))
