"""Injected faults (debug.inject): hang, crash and NaN at a step, once per job or every time.

The crash and hang tests run `python -m engine.train` for real: the exit status, the
traceback, SIGTERM being ignored and SIGKILL being needed are what the supervisor sees."""

import json
import math
import queue
import signal
import subprocess
import threading
import time

import pytest

from engine import exit_codes
from engine.spec.schema import InjectConfig
from engine.data.loader import AccumSchedule
from engine.health.faults import SPIKE, Faults, NoFaults
from engine.train import Trainer
from tests.conftest import PYTHON, TINY_JOB, python_env
from testkit.recorders import Recorder

ARGS = ("train.max_steps=6", "train.log_interval=1", "scheduler.warmup_steps=1", "data.micro_batch_size=2",
        "data.seq_len=32", "data.corpus_bytes=400000", "checkpoint.interval_steps=2")


def markers(home):
    path = home / "jobs" / "tiny-cpu" / "faults"
    return sorted(p.name for p in path.iterdir()) if path.is_dir() else []


# --- in-process ---


def test_a_fault_fires_once_per_job_unless_repeat(tmp_path):
    once = Faults(InjectConfig(crash_at_step=[2]), tmp_path, AccumSchedule(1))
    once.at_step_boundary(1)
    with pytest.raises(RuntimeError, match="injected crash after step 2"):
        once.at_step_boundary(2)
    record = json.loads((tmp_path / "faults" / "crash-2").read_text())  # written before it fired
    assert record["kind"] == "crash" and record["step"] == 2
    Faults(InjectConfig(crash_at_step=[2]), tmp_path, AccumSchedule(1)).at_step_boundary(2)  # a restart: passes
    with pytest.raises(RuntimeError):
        Faults(InjectConfig(crash_at_step=[2], repeat=True), tmp_path, AccumSchedule(1)).at_step_boundary(2)


def test_nan_poisons_the_micro_batches_of_the_step_in_the_unskipped_stream(tmp_path):
    faults = Faults(InjectConfig(nan_at_step=[3]), tmp_path, AccumSchedule(4, ((2, 1),)))
    # Steps 1-2 have one micro-batch each (indices 0, 1), step 3 has four (2-5).
    assert [i for i in range(10) if math.isnan(faults.poison(i))] == [2, 3, 4, 5]
    assert [i for i in range(10) if math.isnan(faults.poison(i))] == [2, 3, 4, 5]  # one firing covers the step
    assert Faults(InjectConfig(nan_at_step=[3]), tmp_path, AccumSchedule(4, ((2, 1),))).poison(2) == 1.0
    spikes = Faults(InjectConfig(spike_at_step=[2]), tmp_path / "other", AccumSchedule(1))
    assert [spikes.poison(i) for i in range(4)] == [1.0, SPIKE, 1.0, 1.0]


@pytest.mark.parametrize("repeat", [False, True])
def test_nan_once_is_gone_after_a_restart_and_repeat_comes_back(tiny_spec, tmp_path, repeat):
    spec = tiny_spec(*ARGS, "health.nonfinite=stop", "debug.inject.nan_at_step=3", f"debug.inject.repeat={repeat}")
    assert Trainer(spec, tmp_path, first := Recorder()).run() == exit_codes.NONFINITE_LOSS
    assert first.nonfinite.step == 3
    again = Trainer(spec, tmp_path, second := Recorder())
    assert again.progress.step == 2 and again.loader.skips == ()  # stop: nothing skipped
    if repeat:
        assert again.run() == exit_codes.NONFINITE_LOSS and second.nonfinite.step == 3
    else:
        assert again.run() == exit_codes.OK and sorted(second.losses) == [3, 4, 5, 6]
    assert markers(tmp_path) == ["nan-3"]


def test_no_faults_no_cost(tiny_spec, tmp_path):
    trainer = Trainer(tiny_spec(*ARGS), tmp_path)
    assert isinstance(trainer.faults, NoFaults)


# --- real processes ---


class Worker:
    """`python -m engine.train` with a thread reading its JSON log lines into a queue."""

    def __init__(self, home, *overrides):
        self.proc = subprocess.Popen(
            [PYTHON, "-m", "engine.train", str(TINY_JOB), *ARGS, *overrides, "--state-dir", str(home)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=python_env())
        self.lines: queue.Queue = queue.Queue()
        self.records = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))

    def until(self, predicate, timeout=120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                record = self.lines.get(timeout=0.5)
            except queue.Empty:
                continue
            self.records.append(record)
            if predicate(record):
                return record
        raise AssertionError(f"no such line within {timeout}s; last: {self.records[-3:]}")

    def quiet_for(self, seconds):
        """The records that arrive within `seconds`."""
        end, seen = time.monotonic() + seconds, []
        while (left := end - time.monotonic()) > 0:
            try:
                seen.append(self.lines.get(timeout=left))
            except queue.Empty:
                pass
        self.records += seen
        return seen

    def finish(self, timeout=300):
        code = self.proc.wait(timeout)
        stderr = self.proc.stderr.read()
        self.reader.join()
        while not self.lines.empty():
            self.records.append(self.lines.get())
        return code, stderr

    def steps(self):
        return [r["step"] for r in self.records if r["event"] == "step"]


# A repeating crash, and a restart after a hang, in real processes: tests/test_health.py (under the daemon).


@pytest.mark.slow
def test_crash_exits_1_with_a_traceback_then_once_passes(tmp_path):
    once = Worker(tmp_path, "debug.inject.crash_at_step=3")
    code, stderr = once.finish()
    assert code == 1 and "Traceback" in stderr and "RuntimeError: injected crash after step 3" in stderr
    assert once.steps()[-1] == 3 and markers(tmp_path) == ["crash-3"]
    rerun = Worker(tmp_path, "debug.inject.crash_at_step=3")
    assert rerun.finish()[0] == 0
    assert rerun.steps() == [3, 4, 5, 6]  # resumed at the step 2 checkpoint, passed step 3


@pytest.mark.slow
def test_hang_stops_all_progress_ignores_sigterm_and_dies_on_sigkill(tmp_path):
    hung = Worker(tmp_path, "debug.inject.hang_at_step=3")
    try:
        hung.until(lambda r: r["event"] == "injected hang")
        assert hung.steps()[-1] == 3
        if not [r for r in hung.records if r["event"] == "checkpoint committed"]:
            # The step-2 checkpoint's writer thread is not part of the hang; let it finish.
            hung.until(lambda r: r["event"] == "checkpoint committed")
        assert hung.quiet_for(3) == []  # nothing more: no step, no checkpoint, no log line
        hung.proc.send_signal(signal.SIGTERM)
        assert hung.quiet_for(3) == [] and hung.proc.poll() is None  # SIGTERM changes nothing
    finally:
        hung.proc.send_signal(signal.SIGKILL)
    assert hung.finish()[0] == -signal.SIGKILL
    assert markers(tmp_path) == ["hang-3"]  # what makes the restart pass the step
