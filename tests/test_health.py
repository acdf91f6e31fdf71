"""Health signals end to end: injected hangs, crashes and NaNs under a real daemon, and the
wandb run that spans the restarts. Fault injection must be allowed in the daemon settings."""

from __future__ import annotations

import math
import time

import pytest

from tests.conftest import REPO
from testkit.helpers import Daemon, children_by_kind, exits, metric
from tests.test_tracking import history_rows, offline_runs

pytestmark = pytest.mark.slow
JOB = f"""\
name: sick
include: {REPO}/configs/jobs/tiny-cpu.yaml
data: {{corpus_bytes: 400000, seq_len: 64, micro_batch_size: 2}}
train: {{max_steps: 24, log_interval: 1}}
scheduler: {{warmup_steps: 1}}
checkpoint: {{interval_steps: 4, memory: null}}  # restores from disk steps these tests name
restart: {{max_restarts: 2, backoff_initial_seconds: 0.5}}
health: {{heartbeat_timeout_seconds: 3, startup_steps: 1, kill_grace_seconds: 1}}
"""


def start(home, extra: str = "", allow: bool = True, env: dict | None = None, job: str = JOB) -> Daemon:
    (home / "jobs.d").mkdir(parents=True)
    (home / "tpud.yaml").write_text(f"allow_fault_injection: {str(allow).lower()}\n")
    (home / "jobs.d" / "sick.yaml").write_text(job + extra)
    return Daemon(home, env=env)


def stopped(daemon: Daemon) -> None:
    daemon.proc.terminate()
    daemon.proc.wait(timeout=60)


def test_an_injected_hang_is_detected_within_its_bound_killed_and_resumed(tmp_path):
    daemon = start(tmp_path, "debug: {inject: {hang_at_step: 9}}\n")
    try:
        jobs = daemon.wait_for(lambda jobs: jobs["sick"]["state"] in ("SUCCEEDED", "FAILED"), "the end", timeout=180)
        assert jobs["sick"]["state"] == "SUCCEEDED"
        [hung] = daemon.events("worker hung; terminating it")
        # Steps take ~30 ms, so the bound is the 3 s floor (10 x the median step on a loaded box);
        # the daemon wakes when the bound runs out.
        assert 3.0 <= hung["bound_s"] < 10 and hung["bound_s"] < hung["silent_s"] <= hung["bound_s"] + 0.5
        assert hung["step"] == 9
        assert exits(daemon) == [137, 0]  # SIGTERM ignored by the hung loop: SIGKILL after the grace
        restored = daemon.events("checkpoint restored")
        assert [r["step"] for r in restored] == [8]
        assert metric(tmp_path, "tpud_job_restarts_total", job="sick", reason="hang") == 1
        # Both workers were forked by the one fork server, the restart without waiting for imports.
        assert [w["forked"] for w in daemon.events("worker started")] == [True, True]
        assert len(daemon.events("fork server started")) == 1
        assert children_by_kind(daemon.proc.pid).get("worker") is None
    finally:
        stopped(daemon)


def test_a_repeating_crash_backs_off_spends_the_budget_and_fails_with_the_reason(tmp_path):
    daemon = start(tmp_path, "debug: {inject: {crash_at_step: 3, repeat: true}}\n")
    try:
        jobs = daemon.wait_for(lambda jobs: jobs["sick"]["state"] == "FAILED", "FAILED", timeout=180)
        assert "RuntimeError: injected crash after step 3" in jobs["sick"]["error"]
        assert exits(daemon) == [1, 1, 1] and jobs["sick"]["restarts"] == 2
        assert metric(tmp_path, "tpud_job_restarts_total", job="sick", reason="exception") == 2
        states = [(r["state"], r["reason"]) for r in daemon.events("job state")]
        backoffs = [reason for state, reason in states if state == "BACKOFF"]
        assert backoffs == ["exception; restart in 0.5s", "exception; restart in 1.0s"]
        assert "restart budget spent" in states[-1][1]
    finally:
        stopped(daemon)


def test_a_nan_and_a_spike_roll_back_in_place_skip_their_batches_and_finish(tmp_path):
    """No restart: the worker goes back to its newest checkpoint before each bad step itself;
    status, the log and the metrics say what it skipped."""
    daemon = start(tmp_path, "debug: {inject: {nan_at_step: 6, spike_at_step: 20}}\n",
                   job=JOB.replace("health: {", "health: {spikes: {warmup_steps: 8, window_steps: 8}, "))
    try:
        jobs = daemon.wait_for(lambda jobs: jobs["sick"]["state"] in ("SUCCEEDED", "FAILED"), "the end", timeout=180)
        job = jobs["sick"]
        assert job["state"] == "SUCCEEDED", job
        assert exits(daemon) == [0] and job["restarts"] == 0
        rolled = daemon.events("rolled back")
        assert [(r["step"], r["kind"], r["restored_step"], r["verdict"]) for r in rolled] == [
            (6, "nonfinite", 4, "data"), (19, "spike", 16, "data")]  # step 20's batch, one skip earlier
        # Micro-batches 5 (step 6) and 19 (step 20): two sequences each.
        assert job["healing"]["skipped"]["samples"] == 4 and job["healing"]["rollbacks"] == 2
        after = [r for r in daemon.events("step") if r.get("step", 0) >= 5][-20:]
        assert after and all(math.isfinite(r["loss"]) for r in after if "loss" in r)
        assert metric(tmp_path, "tpud_job_rollbacks_total", job="sick", kind="nonfinite", verdict="data") == 1
        assert metric(tmp_path, "tpud_job_rollbacks_total", job="sick", kind="spike", verdict="data") == 1
        assert metric(tmp_path, "tpud_job_skipped_samples_total", job="sick") == 4
        assert metric(tmp_path, "tpud_badput_seconds_total", job="sick", kind="rollback") > 0
        status = daemon.cli("status").stdout
        assert "sick: healing: 2 rollbacks, " in status and "4 samples skipped in 2 ranges" in status
        listing = daemon.cli("checkpoints", str(tmp_path / "jobs.d" / "sick.yaml")).stdout
        newest = listing.splitlines()[2].split()  # the final step's: both skips behind it
        assert newest[1] == "24" and newest[-2] == "2" and "skip ledger: 4 samples skipped in 2 ranges" in listing
    finally:
        stopped(daemon)


def test_a_nan_with_policy_stop_fails_the_job_with_exit_76(tmp_path):
    stop_policy = JOB.replace("health: {", "health: {nonfinite: stop, ")
    daemon = start(tmp_path, "debug: {inject: {nan_at_step: 6}}\n", job=stop_policy)
    try:
        jobs = daemon.wait_for(lambda jobs: jobs["sick"]["state"] == "FAILED", "FAILED", timeout=180)
        assert exits(daemon) == [76] and "non-finite loss" in jobs["sick"]["error"]
        assert jobs["sick"]["restarts"] == 0
        # jobs.d read again (another file dropped in): the failure keeps its explanation. Before, any
        # read of the unchanged file cleared it, and status showed a FAILED job with no error.
        (tmp_path / "jobs.d" / "broken.yaml").write_text("name: [\n")
        jobs = daemon.wait_for(lambda jobs: "broken" in jobs, "the other file read", timeout=60)
        assert jobs["sick"]["state"] == "FAILED" and "non-finite loss" in jobs["sick"]["error"]
    finally:
        stopped(daemon)


def test_fault_injection_is_refused_unless_the_settings_allow_it(tmp_path):
    daemon = start(tmp_path, "debug:\n  inject: {crash_at_step: 3}\n", allow=False)
    try:
        jobs = daemon.wait_for(lambda jobs: "sick" in jobs, "the job in status")
        assert jobs["sick"]["state"] == "INVALID"
        where = f"{tmp_path / 'jobs.d' / 'sick.yaml'}:10: debug.inject"
        assert f"{where}: fault injection is refused" in jobs["sick"]["error"]
        time.sleep(1)
        assert exits(daemon) == []
    finally:
        stopped(daemon)


def test_one_wandb_run_spans_the_workers_restarts(tmp_path):
    wandb_dirs = {f"WANDB_{k}": str(tmp_path / "wandb" / k.lower()) for k in ("CONFIG_DIR", "CACHE_DIR", "DATA_DIR")}
    daemon = start(tmp_path, "debug: {inject: {crash_at_step: 10}}\n"
                             "logging: {wandb: {project: tpud-test, mode: offline}}\n", env=wandb_dirs)
    try:
        jobs = daemon.wait_for(lambda jobs: jobs["sick"]["state"] in ("SUCCEEDED", "FAILED"), "the end", timeout=180)
        assert jobs["sick"]["state"] == "SUCCEEDED" and exits(daemon) == [1, 0]
    finally:
        stopped(daemon)
    [(run_id, records)] = offline_runs(tmp_path / "state" / "jobs" / "sick")
    rows = history_rows(records)
    steps = [row["train/step"] for row in rows]
    # The crash after step 10 resumed from step 8: steps 9 and 10 come twice, wandb's own step never goes back.
    assert steps == list(range(1, 11)) + list(range(9, 25))
    assert [row["_step"] for row in rows] == sorted({row["_step"] for row in rows})
    saved = sorted((tmp_path / "state" / "checkpoints" / "sick").glob("step_*/manifest.json"))
    assert saved and all(f'"wandb_run_id": "{run_id}"' in p.read_text() for p in saved)
