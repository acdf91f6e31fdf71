"""The training loop in-process on CPU: learning, determinism, accumulation, hooks, badput, manifests."""

import json
import time

import pytest
import torch

from engine import events, exit_codes
from engine.checkpoint import manifest as mf
from engine.hooks import Boundary
from engine.requests import Action, Request
from engine.train import Trainer
from testkit.recorders import Recorder, StepLosses

SHORT = ("train.max_steps=12", "train.log_interval=4", "scheduler.warmup_steps=2", "data.micro_batch_size=4",
         "data.seq_len=64")


def run(spec, tmp_path, hooks=None):
    hooks = hooks or StepLosses()
    trainer = Trainer(spec, tmp_path, hooks)
    return trainer, hooks, trainer.run()


def test_loss_falls_and_every_step_is_reported(tiny_spec, tmp_path):
    trainer, hooks, code = run(tiny_spec(*SHORT, "optimizer.lr=3e-3"), tmp_path)
    assert code == exit_codes.OK and trainer.step == 12
    steps = hooks.of(events.Step)
    assert [e.step for e in steps] == list(range(1, 13))
    assert all(e.tokens_per_s > 0 and e.mfu is None for e in steps)  # no MFU on CPU
    # Near ln(256) = 5.55 at init; a little below because a tied head already favours
    # repeating the input byte, and Python source repeats spaces a lot.
    assert 4.5 < steps[0].loss < 5.7
    assert steps[-1].loss < steps[0].loss - 1.0
    assert isinstance(hooks.events[0], events.Started) and isinstance(hooks.events[-1], events.CheckpointCommitted)


def test_same_seed_same_run_bit_for_bit(tiny_spec, tmp_path):
    spec = tiny_spec(*SHORT)
    a, ha, _ = run(spec, tmp_path / "a")
    b, hb, _ = run(spec, tmp_path / "b")
    assert ha.losses == hb.losses
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)
    c, hc, _ = run(tiny_spec(*SHORT, "train.seed=1"), tmp_path / "c")
    assert hc.losses != ha.losses


def test_gradient_accumulation_matches_one_big_batch(tiny_spec, tmp_path):
    big, hbig, _ = run(tiny_spec(*SHORT, "train.max_steps=3", "data.micro_batch_size=4"), tmp_path / "big")
    acc, hacc, _ = run(tiny_spec(*SHORT, "train.max_steps=3", "data.micro_batch_size=2",
                                 "train.grad_accum_steps=2"), tmp_path / "acc")
    # Same sequences per step, summed in a different order: equal up to float rounding, which
    # after three AdamW steps reaches a few 1e-6 in a weight near zero (whose relative error is large).
    assert hacc.losses == pytest.approx(hbig.losses, rel=1e-5)
    for pa, pb in zip(big.model.parameters(), acc.model.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-4, atol=1e-5)


def test_hooks_are_polled_at_every_micro_batch_and_step_boundary(tiny_spec, tmp_path):
    _, hooks, _ = run(tiny_spec(*SHORT, "train.max_steps=2", "scheduler.warmup_steps=1", "train.grad_accum_steps=3"), tmp_path)
    assert hooks.boundaries == [Boundary(s, m) for s in range(2) for m in range(3)]


def test_stop_request_mid_accumulation_exits_75(tiny_spec, tmp_path):
    hooks = Recorder({Boundary(step=1, micro_step=1): Request(Action.STOP, deadline_s=0)})
    trainer, _, code = run(tiny_spec(*SHORT, "train.grad_accum_steps=2"), tmp_path, hooks)
    assert code == exit_codes.STOPPED and trainer.step == 1


def test_step_events_carry_cumulative_badput_by_kind(tiny_spec, tmp_path):
    spec = tiny_spec(*SHORT, "train.max_steps=6", "train.log_interval=1", "checkpoint.interval_steps=2",
                     "checkpoint.async=false")
    trainer = Trainer(spec, tmp_path, hooks := Recorder())
    fetch = trainer.batches.batch

    def slow_fetch(step, micro_step):  # a slow input pipeline: the loop waits 10 ms for each batch
        time.sleep(0.01)
        return fetch(step, micro_step)

    trainer.batches.batch = slow_fetch
    trainer.run()
    (started,) = [e.badput for e in hooks.of(events.Started)]
    assert started.startup > 0 and started.data == started.checkpoint == 0
    assert started.restore < 0.5  # nothing to restore
    steps = {e.step: e.badput for e in hooks.of(events.Step)}
    assert steps[1].startup > started.startup  # the first step is startup too (XLA compiles there)
    assert all(steps[s].startup == steps[1].startup for s in steps)  # and only the first
    for kind in events.BADPUT_KINDS:  # cumulative
        assert [getattr(steps[s], kind) for s in sorted(steps)] == sorted(getattr(steps[s], kind) for s in steps)
    # Counted once: the first step's fetch is data, not startup.
    assert 0.01 <= steps[1].data < 0.1 and 0.06 <= steps[6].data < 0.5
    # Sync saves at steps 2 and 4: the loop waits for each whole write.
    written = {e.step: e.seconds for e in hooks.of(events.CheckpointCommitted)}
    assert steps[2].checkpoint == 0 and steps[3].checkpoint >= written[2] - 0.002 > 0
    assert steps[5].checkpoint >= written[2] + written[4] - 0.004

    resumed = Recorder()
    Trainer(tiny_spec(*SHORT, "train.max_steps=8", "train.log_interval=1"), tmp_path, resumed).run()
    (started,) = [e.badput for e in resumed.of(events.Started)]
    (restored,) = resumed.of(events.CheckpointRestored)
    assert started.restore >= restored.seconds > 0


def test_manifests_carry_the_wandb_run_id_and_old_manifests_still_read(tiny_spec, tmp_path):
    from engine.runtime import Runtime

    told = Runtime.from_env({"TPUD_WANDB_RUN_ID": "run-1234"})  # as the daemon tells its worker
    assert Trainer(tiny_spec(*SHORT, "train.max_steps=2", "scheduler.warmup_steps=1"), tmp_path, Recorder(),
                   runtime=told).run() == 0
    (_, path, manifest), = mf.committed_steps(tmp_path / "checkpoints" / "tiny-cpu")
    assert manifest.wandb_run_id == "run-1234" and manifest.data_skips == ()
    data = json.loads((path / mf.MANIFEST).read_text())
    assert data["wandb_run_id"] == "run-1234" and data["data_skips"] == []
    old = {k: v for k, v in data.items() if k not in ("wandb_run_id", "data_skips")}  # written before they existed
    assert mf.Manifest.from_json(json.dumps(old)) == mf.Manifest.from_json(json.dumps({**data, "wandb_run_id": None}))
    newer = {**data, "data_skips": [[4, 2]], "added_later": 1}  # a newer writer's field is ignored
    assert mf.Manifest.from_json(json.dumps(newer)).data_skips == ((4, 2),)


def test_a_gang_change_while_taking_a_peers_state_takes_the_wrapper_off_the_kept_model(tiny_spec, tmp_path,
                                                                                        monkeypatch):
    """A peer lost during the live-state broadcast fails the next trainer's construction: it must
    unhook its wrapper (DDP's gradient hooks) from the model the worker keeps, or the trainer after
    it would sum every gradient through a dead process group as well as its own."""
    import engine.train as train
    from engine.checkpoint.hosts import Hosts
    from engine.errors import GangChanged

    spec = tiny_spec("train.max_steps=2", "scheduler.warmup_steps=1")
    first = Trainer(spec, tmp_path / "a", Recorder())
    first.run()
    warm, released = first.warm(), []
    monkeypatch.setattr(type(first.backend), "release", lambda self, module: released.append(module))

    def peer_lost(*args):
        raise GangChanged("a peer left while its state was sent")

    monkeypatch.setattr(train, "take_live_state", peer_lost)
    with pytest.raises(GangChanged):
        Trainer(spec, tmp_path / "a", Recorder(), Hosts(0, 1, source=0, transfer=True), warm)
    assert len(released) == 1 and released[0].model is warm.model


def test_a_gang_changed_in_place_to_another_size_skips_the_samples_its_survivors_skipped(tiny_spec, tmp_path):
    """A survivor's skips are in micro-batches of the old gang's size; the next trainer skips (and
    records in its ledger) the same samples in micro-batches of its own."""
    import dataclasses

    from engine.checkpoint.hosts import Hosts

    spec = tiny_spec("train.max_steps=2", "scheduler.warmup_steps=1")
    first = Trainer(spec, tmp_path / "a", Recorder())
    first.run()
    per = first.ledger.per_micro_batch
    # The old gang was twice this one: its micro-batches 10 and 11 are this one's 20 .. 23.
    warm = dataclasses.replace(first.warm(), skips=[(10, 2)], per_micro_batch=2 * per)
    second = Trainer(spec, tmp_path / "a", Recorder(), Hosts(0, 1, source=0, transfer=False), warm)
    assert (20, 4) in second.loader.skips and (10, 2) not in second.loader.skips
    assert [e.samples for e in second.ledger.entries] == [(20 * per, 4 * per)]
