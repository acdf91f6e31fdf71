"""Non-finite losses (health.nonfinite): skipped batches in the loader, no checkpoint of a bad
step, exit 76, and a rollback that trains past the bad batches. Real training on CPU."""

import json
import math
import random
import subprocess

import numpy as np
import pytest
import torch

from engine import events, exit_codes
from engine.backends.base import DataPosition
from engine.checkpoint import manifest as mf
from engine.data.batch import Batch
from engine.data.loader import AccumSchedule, merge_skips, read_skips, write_skips
from tests.recorders import array_loader
from engine.hooks import Boundary
from engine.requests import Action, Request
from engine.layout import StateLayout
from engine.train import Trainer
from tests.conftest import PYTHON, TINY_JOB, python_env
from tests.recorders import Recorder

# --- the loader's skips ---

TOKENS = np.arange(8 * 97, dtype=np.int64)  # 97 windows of 8 distinct tokens
RAMP = AccumSchedule(3, ((2, 1), (4, 2)))


def loader(accum=1, skips=(), mb=1, rank=0, world=1):
    return array_loader(TOKENS, seq_len=7, micro_batch_size=mb, accum=accum, seed=0,
                        position=DataPosition(rank, world), skips=skips)


def stream(data, steps):
    """The global micro-batch index of every (step, micro-step), in order."""
    return [data.index(s, m) for s in range(steps) for m in range(data.accum.at(s))]


def test_a_skipped_range_is_jumped_over_and_everything_after_moves_on():
    flat, skipping = loader(), loader(skips=[(2, 1)])
    assert stream(skipping, 6) == [0, 1, 3, 4, 5, 6]
    assert skipping.batch(2, 0) == flat.batch(3, 0)
    assert skipping.batch(1, 0) == flat.batch(1, 0)  # before the range: unchanged
    assert skipping.tokens_in_steps(0, 6) == flat.tokens_in_steps(0, 6)  # the same work per step
    assert skipping.state_dict() == flat.state_dict()  # the geometry check does not see skips


def test_skip_range_covers_a_whole_step_under_accumulation_and_a_ramp():
    acc = loader(accum=2)
    assert acc.skip_range(3) == (6, 2)
    acc.skips = [acc.skip_range(3)]
    assert [acc.index(3, m) for m in range(2)] == [8, 9] and acc.index(2, 1) == 5
    ramped = loader(accum=RAMP)  # steps 0-1: 1 micro-batch, 2-3: 2, then 3
    assert [ramped.skip_range(s) for s in (1, 2, 4)] == [(1, 1), (2, 2), (6, 3)]
    ramped.skips = [ramped.skip_range(2)]
    assert stream(ramped, 5) == [0, 1, 4, 5, 6, 7, 8, 9, 10]


def test_every_rank_skips_the_same_micro_batches():
    skip = [(3, 2)]
    whole = loader(accum=2, mb=4, skips=skip)
    for step in range(4):
        for m in range(2):
            ranks = [loader(accum=2, mb=2, rank=r, world=2, skips=skip).batch(step, m) for r in range(2)]
            assert Batch.cat(ranks) == whole.batch(step, m)


@pytest.mark.parametrize("seed", range(20))
def test_rollbacks_in_any_order_drop_exactly_the_bad_steps_batches(seed):
    """Random rollbacks, some to before earlier ones: each removes exactly the micro-batches the
    bad step had at the time, whatever skips were there; none of them ever comes back."""
    rng = random.Random(seed)
    accum = rng.choice([AccumSchedule(1), AccumSchedule(3), RAMP, AccumSchedule(4, ((3, 1), (5, 3)))])
    data, dropped = loader(accum=accum), set()
    for _ in range(rng.randint(1, 6)):
        bad = rng.randrange(12)
        before = stream(data, 20)
        bad_batches = [data.index(bad, m) for m in range(accum.at(bad))]
        first, count = data.skip_range(bad)
        assert (first, count) == (bad_batches[0], len(bad_batches))
        data.skips = merge_skips(data.skips, [(first, count)])
        dropped |= set(bad_batches)
        after = stream(data, 20)
        # The new stream is the old one without the bad step's batches, continuing past them.
        kept = [i for i in before if i not in bad_batches]
        assert after[:len(kept)] == kept and len(after) == len(before)
        assert not dropped & set(after)
        assert after == sorted(after) and len(set(after)) == len(after)


def test_skips_persist_atomically_and_merge(tmp_path):
    path = StateLayout(tmp_path).skips_file("j")
    assert read_skips(path) == ()
    write_skips(path, ((9, 2), (4, 1)))
    assert json.loads(path.read_text()) == {"format": 1, "skips": [[9, 2], [4, 1]]}
    assert read_skips(path) == ((4, 1), (9, 2))
    assert merge_skips([(4, 1)], [[9, 2], [4, 1]]) == ((4, 1), (9, 2))
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left behind
    with pytest.raises(ValueError):
        merge_skips([(3, 0)])


# --- the training loop ---

QUICK = ("train.max_steps=8", "train.log_interval=4", "scheduler.warmup_steps=1", "data.micro_batch_size=2",
         "data.seq_len=32", "train.grad_accum_steps=2", "checkpoint.interval_steps=2", "checkpoint.keep=10")


def committed(home):
    return [(step, m.micro_step) for step, _, m in mf.committed_steps(home / "checkpoints" / "tiny-cpu")]


def test_rollback_skips_the_bad_steps_batches_and_finishes_finite(tiny_spec, tmp_path):
    home = tmp_path / "rollback"
    # NaN at step 3, found only when the save at step 4 reads steps 3-4 (log_interval 4).
    first = Trainer(tiny_spec(*QUICK, "debug.inject.nan_at_step=3"), home, script := Recorder())
    assert first.run() == exit_codes.NONFINITE_LOSS
    assert committed(home) == [(2, 0)]  # step 4 held the bad update: never saved
    (event,) = script.of(events.NonFinite)
    assert event.step == 3 and math.isnan(event.loss) and event.policy == "rollback"
    assert event.skip == (4, 2)  # step 3 (index 2): micro-batches 4 and 5
    assert json.loads(StateLayout(home).skips_file("tiny-cpu").read_text())["skips"] == [[4, 2]]
    assert 3 not in script.losses

    second = Trainer(tiny_spec(*QUICK, "debug.inject.nan_at_step=3"), home, resumed := Recorder())
    assert second.progress.step == 2 and second.loader.skips == ((4, 2),)
    assert second.run() == exit_codes.OK
    losses = resumed.losses
    assert sorted(losses) == list(range(3, 9)) and all(math.isfinite(v) for v in losses.values())

    # Against runs without faults: the same before the bad step; from it on, exactly the run
    # whose data skips micro-batches 4-5 from the start.
    Trainer(tiny_spec(*QUICK), tmp_path / "whole", whole := Recorder()).run()
    skipping_home = tmp_path / "skipping"
    write_skips(StateLayout(skipping_home).skips_file("tiny-cpu"), ((4, 2),))
    Trainer(tiny_spec(*QUICK), skipping_home, skipping := Recorder()).run()
    assert {s: script.losses[s] for s in (1, 2)} == {s: whole.losses[s] for s in (1, 2)}
    assert losses[3] != whole.losses[3]
    assert losses == {s: skipping.losses[s] for s in range(3, 9)}

    # Every later checkpoint carries the skips: a host without the state file still skips.
    assert mf.committed_steps(home / "checkpoints" / "tiny-cpu")[-1][2].data_skips == ((4, 2),)
    StateLayout(home).skips_file("tiny-cpu").unlink()
    assert Trainer(tiny_spec(*QUICK, "train.max_steps=10"), home, Recorder()).loader.skips == ((4, 2),)


def test_a_partial_step_checkpoint_is_refused_when_its_accumulated_loss_is_nan(tiny_spec, tmp_path):
    # Step 3's first micro-batch is poisoned; a checkpoint is asked for right after it.
    exit_after = {Boundary(2, 1): Request(Action.CHECKPOINT_AND_EXIT, deadline_s=0)}
    t = Trainer(tiny_spec(*QUICK, "debug.inject.nan_at_step=3", "health.nonfinite=stop"), tmp_path,
                script := Recorder(exit_after))
    assert t.run() == exit_codes.NONFINITE_LOSS
    assert committed(tmp_path) == [(2, 0)]
    (event,) = script.of(events.NonFinite)
    assert event.step == 3 and event.policy == "stop" and event.skip is None
    assert not StateLayout(tmp_path).skips_file("tiny-cpu").exists()


def test_an_infinite_grad_norm_counts_as_non_finite(tiny_spec, tmp_path, monkeypatch):
    t = Trainer(tiny_spec(*QUICK, "train.log_interval=1", "checkpoint.interval_steps=0"), tmp_path,
                script := Recorder())
    real = torch.nn.utils.clip_grad_norm_
    calls = []

    def clip(params, max_norm):
        calls.append(1)
        norm = real(params, max_norm)
        return norm * float("inf") if len(calls) == 2 else norm

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    assert t.run() == exit_codes.NONFINITE_LOSS
    (event,) = script.of(events.NonFinite)
    assert event.step == 2 and math.isfinite(event.loss) and event.grad_norm == float("inf")
    assert [e.step for e in script.of(events.Step)] == [1]  # a bad step is not reported as a step


@pytest.mark.slow
def test_nan_with_policy_stop_exits_76_without_checkpointing_the_bad_step(tmp_path):
    # log_interval 10: the NaN of step 3 would reach the host only at step 8; the save at step 4
    # must read and check steps 3-4 first, find the NaN, and not commit.
    args = [*QUICK, "train.log_interval=10", "data.corpus_bytes=400000", "health.nonfinite=stop",
            "debug.inject.nan_at_step=3"]
    proc = subprocess.run([PYTHON, "-m", "engine.train", str(TINY_JOB), *args, "--state-dir", str(tmp_path)],
                          capture_output=True, text=True, env=python_env(), timeout=300)
    assert proc.returncode == exit_codes.NONFINITE_LOSS, proc.stderr[-2000:]
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    (error,) = [r for r in records if r["event"] == "nonfinite"]
    assert error["level"] == "error" and error["step"] == 3 and error["policy"] == "stop"
    assert committed(tmp_path) == [(2, 0)]
    assert not StateLayout(tmp_path).skips_file("tiny-cpu").exists()


@pytest.mark.slow
@pytest.mark.xla
def test_under_xla_the_asynchronous_reads_are_checked_before_a_save_and_the_rollback_finishes(tmp_path):
    """On XLA the values reach the host on a reader thread: the save at step 4 must wait for them."""
    pytest.importorskip("torch_xla")
    args = [*QUICK, "train.log_interval=10", "data.corpus_bytes=400000", "data.micro_batch_size=4",
            "device.backend=xla", "train.mixed_precision=fp32", "attention.kernel=eager", "debug.inject.nan_at_step=3",
            "model.n_layers=1"]  # XLA's compile time grows with the layers traced

    def train():
        return subprocess.run([PYTHON, "-m", "engine.train", str(TINY_JOB), *args, "--state-dir", str(tmp_path)],
                              capture_output=True, text=True, timeout=600,
                              env=python_env(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4"))

    first = train()
    assert first.returncode == exit_codes.NONFINITE_LOSS, first.stdout[-3000:] + first.stderr[-3000:]
    assert committed(tmp_path) == [(2, 0)]
    assert read_skips(StateLayout(tmp_path).skips_file("tiny-cpu")) == ((4, 2),)
    second = train()
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    records = [json.loads(line) for line in second.stdout.splitlines()]
    # One log line per report: before the saves at steps 4 and 6, and at the end.
    losses = {r["step"]: r["loss"] for r in records if r["event"] == "step"}
    assert sorted(losses) == [4, 6, 8] and all(math.isfinite(v) for v in losses.values())
