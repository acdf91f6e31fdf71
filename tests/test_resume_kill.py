"""The acceptance test for exact resume: a run SIGKILLed again and again ends bit for bit
where an uninterrupted run ends. Real processes (`python -m engine.train`), real signals."""

import concurrent.futures
import json
import random
import signal
import subprocess
import time

import pytest

from tests.conftest import PYTHON, TINY_JOB, python_env
from testkit.states import assert_same_state, checkpoint_state

pytestmark = pytest.mark.slow
# Big enough (3 M parameters, ~40 MB of state) that a checkpoint write takes a moment.
ARGS = ["train.max_steps=24", "train.grad_accum_steps=3", "train.log_interval=1", "scheduler.warmup_steps=2",
        "data.micro_batch_size=2", "data.seq_len=64", "data.corpus_bytes=400000", "checkpoint.interval_steps=4",
        "model.dim=256", "model.ffn_dim=768", "model.n_heads=4", "model.n_kv_heads=2"]


class Run:
    """One `python -m engine.train` process; its JSON log read line by line."""

    def __init__(self, home):
        self.proc = subprocess.Popen([PYTHON, "-m", "engine.train", str(TINY_JOB), *ARGS, "--state-dir", str(home)],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=python_env())
        self.records = []

    def until(self, predicate):
        for line in self.proc.stdout:
            self.records.append(json.loads(line))
            if predicate(self.records[-1]):
                return self.records[-1]
        raise AssertionError(f"exited ({self.proc.wait()}) before the awaited event; last: {self.records[-3:]}")

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def finish(self):
        self.records += [json.loads(line) for line in self.proc.stdout]
        assert self.proc.wait() == 0
        return self


def losses(records):
    return {r["step"]: r["loss"] for r in records if r["event"] == "step"}


def final_state(home, tmp_path):
    return checkpoint_state(home / "checkpoints" / "tiny-cpu" / "step_000000024", tmp_path)


def test_killed_at_random_moments_the_run_ends_bit_for_bit_as_never_stopped(tmp_path):
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    # The uninterrupted run trains beside the cut one (2 cores); only its end is compared.
    whole = concurrent.futures.ThreadPoolExecutor(1).submit(Run(tmp_path / "whole").finish)

    home, seen, kills = tmp_path / "cut", {}, []
    # 1. A random moment between steps 2 and 9.
    run = Run(home)
    run.until(lambda r: r["event"] == "step" and r["step"] >= rng.randint(2, 9))
    run.kill()
    kills.append("random")
    seen.update(losses(run.records))
    # 2. During an async write: kill as soon as a save starts, until a restart finds the
    #    unfinished directory (proof the kill landed mid-write); it must never be used.
    for _ in range(5):
        run = Run(home)
        first = run.until(lambda r: r["event"] in ("trainer ready", "removing an unfinished checkpoint"))
        if first["event"] == "removing an unfinished checkpoint":
            break
        run.until(lambda r: r["event"] == "checkpoint started")
        time.sleep(rng.uniform(0.02, 0.15))  # the writer thread is a few ms behind the log line
        run.kill()
        kills.append("during write")
        seen.update(losses(run.records))
    else:
        pytest.fail("no kill landed during a checkpoint write")
    # 3. After a SIGUSR1 partial-step checkpoint: signal until one lands mid-accumulation.
    run.until(lambda r: r["event"] == "step")
    while True:
        run.proc.send_signal(signal.SIGUSR1)
        committed = run.until(lambda r: r["event"] == "checkpoint committed")
        if committed["micro_step"]:
            break
    run.kill()
    kills.append("after partial")
    seen.update(losses(run.records))
    resumed = Run(home)
    ready = resumed.until(lambda r: r["event"] == "checkpoint restored")
    assert (ready["step"], ready["micro_step"]) == (committed["step"], committed["micro_step"])
    resumed.finish()
    seen.update(losses(resumed.records))

    assert len(kills) >= 3, kills
    whole = whole.result(timeout=600)
    assert seen == losses(whole.records), f"seed {seed}"  # every step's loss, identical
    assert_same_state(final_state(home, tmp_path), final_state(tmp_path / "whole", tmp_path))
