"""Preemption and maintenance notices end to end: our GCE metadata server, a real daemon,
real workers. A notice costs no step, and the run resumed on a "recreated VM" ends bit for
bit where an uninterrupted run ends."""

from __future__ import annotations

import random
import signal
import subprocess
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from engine.checkpoint import manifest as mf
from tests.conftest import PYTHON, REPO, python_env
from testkit.states import assert_same_state, checkpoint_state
from testkit.helpers import Daemon, exits, metric

pytestmark = pytest.mark.slow
MAX_STEPS = 60
JOB = f"""\
name: pre
include: {REPO}/configs/jobs/tiny-cpu.yaml
data: {{corpus_bytes: 400000, seq_len: 64, micro_batch_size: 2}}
train: {{max_steps: MAX_STEPS, log_interval: 1, grad_accum_steps: ACCUM}}
scheduler: {{warmup_steps: 1}}
checkpoint: {{interval_steps: 0}}
"""


def job_file(home, accum=2, max_steps=MAX_STEPS):
    (home / "jobs.d").mkdir(parents=True, exist_ok=True)
    path = home / "jobs.d" / "pre.yaml"
    path.write_text(JOB.replace("ACCUM", str(accum)).replace("MAX_STEPS", str(max_steps)))
    return path


def uninterrupted(tmp_path, job) -> Future:
    """The same job run straight through without a daemon: the state to end at. It trains beside
    the test's daemon (2 cores); the future's result is that state."""
    state = tmp_path / "whole"
    proc = subprocess.Popen([PYTHON, "-m", "engine.train", str(job), "--state-dir", str(state)], env=python_env(),
                            stdout=subprocess.DEVNULL)

    def end_state():
        assert proc.wait(timeout=300) == 0
        return checkpoint_state(mf.committed_steps(state / "checkpoints" / "pre")[-1][1], tmp_path)

    return ThreadPoolExecutor(1).submit(end_state)


def committed(home):
    return mf.committed_steps(home / "state" / "checkpoints" / "pre")


def newest(home):
    steps = committed(home)
    return steps[-1][2] if steps else None


def stop(daemon):
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(timeout=120) == 0


def finish(home, tmp_path, server, whole):
    """A recreated VM: no notice any more, a new daemon on the same disk resumes and finishes."""
    server.set("instance/preempted", "FALSE")
    server.set("instance/maintenance-event", "NONE")
    daemon = Daemon(home, env={"GCE_METADATA_HOST": server.host})
    try:
        daemon.wait_for(lambda jobs: jobs["pre"]["state"] == "SUCCEEDED", "the resumed job to finish", timeout=300)
    finally:
        stop(daemon)
    end = checkpoint_state(committed(home)[-1][1], tmp_path)
    assert_same_state(end, whole.result(timeout=300))  # its progress: the last step too
    return daemon


def test_a_preemption_notice_loses_no_step_and_the_recreated_vm_resumes_exactly(tmp_path, metadata_server):
    home = tmp_path / "home"
    whole = uninterrupted(tmp_path, job_file(home))
    daemon = Daemon(home, env={"GCE_METADATA_HOST": metadata_server.host})
    try:
        target = random.randint(3, 20)  # well before the end: the notice must find the job running
        jobs = daemon.wait_for(lambda jobs: (jobs["pre"]["step"] or 0) >= target, f"step {target}")
        reached = jobs["pre"]["step"]
        metadata_server.set("instance/preempted", "TRUE")
        daemon.wait_for(lambda jobs: jobs["pre"]["state"] == "PREEMPTED", "PREEMPTED")
        saved = newest(home)
        assert saved is not None and saved.step >= reached, (reached, saved)  # no lost step
        assert exits(daemon) == [75]
        assert metric(home, "tpud_preemption_notices_total", source="preempted") == 1
        time.sleep(2)  # PREEMPTED waits for the host: no new worker
        assert exits(daemon) == [75] and daemon.status()["pre"]["state"] == "PREEMPTED"
    finally:
        stop(daemon)
    resumed = finish(home, tmp_path, metadata_server, whole)
    restored = resumed.events("checkpoint restored")
    assert restored and restored[0]["step"] == saved.step and restored[0]["micro_step"] == saved.micro_step


def test_a_deadline_shorter_than_a_step_takes_a_partial_step_checkpoint_that_resumes_exactly(
        tmp_path, metadata_server):
    home = tmp_path / "home"
    job = job_file(home, accum=12, max_steps=16)  # the notices come by step 11
    (home / "tpud.yaml").write_text("preemption_deadline_seconds: 0.2\n")
    partial = None
    # The earliest boundary after a notice is mid-step 11 times in 12; a notice landing on a
    # step boundary rightly takes a full-step checkpoint, so try again from there. Status shows
    # a step just after its boundary, whose work (the memory save) a loaded machine stretches:
    # the notice waits a random part of a step, or every one could land in that work.
    rng = random.Random(11)
    for attempt in range(4):
        metadata_server.set("instance/preempted", "FALSE")
        daemon = Daemon(home, env={"GCE_METADATA_HOST": metadata_server.host})
        try:
            target = 2 + 3 * attempt
            jobs = daemon.wait_for(lambda jobs: jobs["pre"]["state"] == "RUNNING" and (jobs["pre"]["step"] or 0) >= target,
                                   f"step {target}")
            time.sleep(rng.uniform(0.2, 0.8) * (jobs["pre"]["step_time_s"] or 0.0))
            metadata_server.set("instance/preempted", "TRUE")
            daemon.wait_for(lambda jobs: jobs["pre"]["state"] == "PREEMPTED", "PREEMPTED")
            assert exits(daemon) == [75]
        finally:
            stop(daemon)
        if newest(home).micro_step > 0:
            partial = newest(home)
            break
    assert partial is not None, "every notice landed on a step boundary"
    # The reference trains beside the resumed run only: beside the attempts it would stretch
    # their steps, and with them the waits for each notice.
    resumed = finish(home, tmp_path, metadata_server, uninterrupted(tmp_path, job))
    assert resumed.events("checkpoint restored")[0]["micro_step"] == partial.micro_step


def test_migrate_checkpoints_and_continues_terminate_preempts_and_none_resumes(tmp_path, metadata_server):
    home = tmp_path / "home"
    job_file(home, max_steps=100000)  # still running when each notice arrives, however slow the machine
    (home / "tpud.yaml").write_text("upcoming_maintenance_poll_seconds: 0.5\n")
    daemon = Daemon(home, env={"GCE_METADATA_HOST": metadata_server.host})
    try:
        daemon.wait_for(lambda jobs: (jobs["pre"]["step"] or 0) >= 3, "step 3")
        assert committed(home) == []
        metadata_server.set("instance/maintenance-event", "MIGRATE_ON_HOST_MAINTENANCE")
        deadline = time.monotonic() + 60
        while not committed(home) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert committed(home), "MIGRATE took no checkpoint"
        daemon.wait_for(lambda jobs: jobs["pre"]["state"] == "RUNNING", "RUNNING")
        assert exits(daemon) == []  # the worker carried on
        # A TPU VM's scheduled maintenance, read by polling: a checkpoint, and carry on.
        before = len(committed(home))
        metadata_server.set("instance/upcoming-maintenance",
                            '{"type": "SCHEDULED", "maintenanceStatus": "PENDING", "canReschedule": true}')
        deadline = time.monotonic() + 60
        while len(committed(home)) == before and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(committed(home)) > before, "upcoming maintenance took no checkpoint"
        assert metric(home, "tpud_preemption_notices_total", source="upcoming_maintenance") == 1
        assert exits(daemon) == []
        metadata_server.set("instance/maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE")
        daemon.wait_for(lambda jobs: jobs["pre"]["state"] == "PREEMPTED", "PREEMPTED")
        assert exits(daemon) == [75]
        saved = newest(home)
        assert metric(home, "tpud_preemption_notices_total", source="maintenance_event") == 2
        metadata_server.set("instance/maintenance-event", "NONE")  # the maintenance is over
        daemon.wait_for(lambda jobs: jobs["pre"]["state"] == "RUNNING", "running again")
        restored = daemon.events("checkpoint restored")
        assert restored and (restored[-1]["step"], restored[-1]["micro_step"]) == (saved.step, saved.micro_step)
    finally:
        stop(daemon)
