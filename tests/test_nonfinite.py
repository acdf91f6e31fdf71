"""Non-finite losses (health.nonfinite): skipped batches in the loader and the skip ledger, no
checkpoint of a bad step, a rollback in place that trains past the bad batches, and exit 76
where there is no state to roll back to. Real training on CPU."""

import json
import math
import os
import random
import subprocess

import numpy as np
import pytest
import torch

from engine import events, exit_codes
from engine.backends.base import DataPosition
from engine.checkpoint import manifest as mf
from engine.data.batch import Batch
from engine.data.loader import AccumSchedule, merge_skips
from engine.health.ledger import SkipLedger
from testkit.recorders import array_loader
from engine.hooks import Boundary
from engine.requests import Action, Request
from engine.layout import StateLayout
from engine.train import Trainer
from tests.conftest import PYTHON, TINY_JOB, python_env
from testkit.recorders import Recorder

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


def test_the_ledger_persists_atomically_and_reads_the_old_format(tmp_path):
    path = StateLayout(tmp_path).skips_file("j")
    ledger = SkipLedger(path, per_micro_batch=8, operator=[(20, 3), (100, 1)])
    assert ledger.ranges == ((2, 1), (12, 1)) and not path.exists()  # the job file's: micro-batches 2 and 12
    data = loader(accum=2)
    assert ledger.skip(data, step=5, steps=2, reason="spike", loss=9.5) == (6, 4)  # steps 4-5: micro-batches 6-9
    assert data.skips == ((2, 1), (6, 4), (12, 1))
    saved = json.loads(path.read_text())
    assert saved["skips"] == [[6, 4]] and saved["format"] == 2  # the operator's stay in the job file
    (entry,) = saved["entries"]
    assert entry["samples"] == [48, 32] and (entry["reason"], entry["step"], entry["loss"]) == ("spike", 5, 9.5)
    again = SkipLedger(path, per_micro_batch=8)
    assert again.ranges == ((6, 4),) and again.recent(step=5 + 999, window=1000) == 1
    assert again.recent(step=5 + 1000, window=1000) == 0
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left behind
    path.write_text(json.dumps({"format": 1, "skips": [[9, 2], [4, 1]]}))  # an older tpud's
    assert SkipLedger(path, per_micro_batch=8).ranges == ((4, 1), (9, 2))
    assert merge_skips([(4, 1)], [[9, 2], [4, 1]]) == ((4, 1), (9, 2))
    with pytest.raises(ValueError):
        merge_skips([(3, 0)])


def test_a_damaged_ledger_is_set_aside_and_the_checkpoints_ranges_come_back(tmp_path):
    path = StateLayout(tmp_path).skips_file("j")
    path.parent.mkdir(parents=True)
    path.write_text('{"format": 2, "entries": [{"first": "x"}]}')
    ledger = SkipLedger(path, per_micro_batch=4)
    assert ledger.ranges == () and path.with_name(path.name + ".damaged").exists()
    ledger.adopt([(3, 2)])  # what a restored checkpoint's manifest carries
    assert SkipLedger(path, per_micro_batch=4).summary()["entries"][0]["samples"] == [12, 8]


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_ledger_that_is_not_a_file_never_blocks_the_worker_or_the_daemon(tmp_path, kind):
    from engine.health.ledger import summary_of

    path = StateLayout(tmp_path).skips_file("j")
    path.parent.mkdir(parents=True)
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    assert summary_of(path) is None  # the daemon's status: no ledger shown, no open() on a FIFO
    ledger = SkipLedger(path, per_micro_batch=4)  # the worker: set aside, starts empty
    assert ledger.ranges == () and path.with_name(path.name + ".damaged").exists() and not path.exists()


# --- the training loop ---

QUICK = ("train.max_steps=8", "train.log_interval=4", "scheduler.warmup_steps=1", "data.micro_batch_size=2",
         "data.seq_len=32", "train.grad_accum_steps=2", "checkpoint.interval_steps=2", "checkpoint.keep=10")


def committed(home):
    return [(step, m.micro_step) for step, _, m in mf.committed_steps(home / "checkpoints" / "tiny-cpu")]


def test_rollback_in_place_skips_the_bad_steps_batches_and_finishes_finite(tiny_spec, tmp_path):
    home = tmp_path / "rollback"
    # NaN at step 3, found only when the save at step 4 reads steps 3-4 (log_interval 4): the worker
    # goes back to step 2, replays step 3 (NaN again: the data's), skips its batches and trains on.
    run = Trainer(tiny_spec(*QUICK, "debug.inject.nan_at_step=3"), home, script := Recorder())
    assert run.run() == exit_codes.OK
    (event,) = script.of(events.RolledBack)
    assert (event.step, event.kind, event.restored_step, event.verdict) == (3, "nonfinite", 2, "data")
    assert event.skip == (4, 2)  # step 3 (index 2): micro-batches 4 and 5
    assert event.samples == (8, 4) and event.redone_steps == 1  # 2 sequences a micro-batch
    assert not script.of(events.NonFinite)
    ledger = json.loads(StateLayout(home).skips_file("tiny-cpu").read_text())
    assert ledger["skips"] == [[4, 2]] and ledger["entries"][0]["reason"] == "nonfinite"
    losses = script.losses
    assert sorted(losses) == list(range(1, 9)) and all(math.isfinite(v) for v in losses.values())
    assert (2, 0) in committed(home) and (4, 0) in committed(home)

    # Against runs without faults: the same before the bad step; from it on, exactly the run whose
    # data skips those samples from the start (data.skip: the ledger's sample ranges).
    Trainer(tiny_spec(*QUICK), tmp_path / "whole", whole := Recorder()).run()
    Trainer(tiny_spec(*QUICK, "data.skip=[[8, 4]]"), tmp_path / "skipping", skipping := Recorder()).run()
    assert {s: losses[s] for s in (1, 2)} == {s: whole.losses[s] for s in (1, 2)}
    assert losses[3] != whole.losses[3]
    assert losses == skipping.losses

    # Every later checkpoint carries the skips: a host without the state file still skips.
    assert mf.committed_steps(home / "checkpoints" / "tiny-cpu")[-1][2].data_skips == ((4, 2),)
    StateLayout(home).skips_file("tiny-cpu").unlink()
    assert Trainer(tiny_spec(*QUICK, "train.max_steps=10"), home, Recorder()).loader.skips == ((4, 2),)


def test_with_no_state_before_the_bad_step_the_restart_skips_it(tiny_spec, tmp_path):
    """Nothing saved yet to go back to in place: exit 76, the skip recorded, and the supervisor's
    restart (here: the next Trainer) begins afresh past the bad batches."""
    args = (*QUICK, "checkpoint.interval_steps=0", "debug.inject.nan_at_step=3")
    assert Trainer(tiny_spec(*args), tmp_path, script := Recorder()).run() == exit_codes.NONFINITE_LOSS
    (event,) = script.of(events.NonFinite)
    assert event.step == 3 and math.isnan(event.loss) and event.policy == "rollback" and event.skip == (4, 2)
    assert committed(tmp_path) == []
    second = Trainer(tiny_spec(*args), tmp_path, resumed := Recorder())
    assert second.progress.step == 0 and second.loader.skips == ((4, 2),)
    assert second.run() == exit_codes.OK and all(math.isfinite(v) for v in resumed.losses.values())


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
    """On XLA the values reach the host on a reader thread: the save at step 4 must wait for them,
    find the NaN of step 3, and roll back in place to step 2."""
    pytest.importorskip("torch_xla")
    args = [*QUICK, "train.log_interval=10", "data.corpus_bytes=400000", "data.micro_batch_size=4",
            "device.backend=xla", "train.mixed_precision=fp32", "attention.kernel=eager", "debug.inject.nan_at_step=3",
            "model.n_layers=1"]  # XLA's compile time grows with the layers traced

    def train():
        return subprocess.run([PYTHON, "-m", "engine.train", str(TINY_JOB), *args, "--state-dir", str(tmp_path)],
                              capture_output=True, text=True, timeout=600,
                              env=python_env(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4"))

    run = train()
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    records = [json.loads(line) for line in run.stdout.splitlines()]
    (rolled,) = [r for r in records if r["event"] == "rolled back"]
    assert (rolled["step"], rolled["restored_step"], rolled["verdict"], rolled["skip"]) == (3, 2, "data", [4, 2])
    assert SkipLedger(StateLayout(tmp_path).skips_file("tiny-cpu"), 4).ranges == ((4, 2),)  # 4 sequences a micro-batch
    # One log line per report: before the saves at steps 2, 4 (after the rollback), 6, and at the end.
    losses = {r["step"]: r["loss"] for r in records if r["event"] == "step"}
    assert sorted(losses) == [2, 4, 6, 8] and all(math.isfinite(v) for v in losses.values())
