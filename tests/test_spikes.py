"""Loss spikes (health.spikes): the detector on made-up series, and real runs that roll a spike
back in place, skip its batches, and match a run that skipped them from the start."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from engine import events, exit_codes
from engine.health.spikes import SpikeDetector
from engine.spec.schema import SpikeConfig
from engine.train import Trainer
from testkit.recorders import Recorder


def series(n: int, seed: int, start: float = 4.0, end: float = 2.0, noise: float = 0.05) -> list[tuple[float, float]]:
    """A falling loss with multiplicative noise, and a gradient norm that swings more."""
    rng = random.Random(seed)
    return [(start + (end - start) * i / n) * math.exp(rng.gauss(0, noise)) for i in range(n)], \
        [math.exp(rng.gauss(0, 0.3)) for i in range(n)]


def run(detector: SpikeDetector, losses, norms, first_step: int = 1) -> list:
    return [s for i, (loss, norm) in enumerate(zip(losses, norms))
            if (s := detector.observe(first_step + i, loss, norm)) is not None]


@pytest.mark.parametrize("seed", range(5))
def test_noise_and_a_falling_loss_raise_no_alarm(seed):
    losses, norms = series(2000, seed)
    assert run(SpikeDetector(SpikeConfig()), losses, norms) == []


def test_a_jump_in_the_loss_or_the_norm_is_a_spike_and_stays_out_of_the_history():
    losses, norms = series(400, 0)
    losses[300] *= 1.6
    norms[350] *= 20
    found = run(SpikeDetector(SpikeConfig()), losses, norms)
    assert [(s.step, s.signal) for s in found] == [(301, "loss"), (351, "grad_norm")]
    assert found[0].value / found[0].median == pytest.approx(1.6, rel=0.1) and found[0].deviations > 6
    assert "1.6" in found[0].describe() or "1.5" in found[0].describe()


def test_a_rise_too_small_to_matter_is_not_a_spike_however_flat_the_window():
    losses = [2.0] * 200  # no spread at all: any rise is infinitely many deviations
    losses[150] = 2.0 * 1.2  # but under loss_ratio 1.25
    assert run(SpikeDetector(SpikeConfig()), losses, [1.0] * 200) == []
    losses[160] = 2.0 * 1.3
    assert [s.step for s in run(SpikeDetector(SpikeConfig()), losses, [1.0] * 200)] == [161]


def test_nothing_is_called_in_warmup_or_before_a_quarter_window_after_a_start():
    cfg = SpikeConfig(warmup_steps=50, window_steps=64)
    losses, norms = series(200, 1)
    losses[40] *= 3  # in warmup
    losses[120] *= 3  # after a start at step 110: 10 steps of history, under 16
    detector = SpikeDetector(cfg)
    assert run(detector, losses[:60], norms[:60]) == []
    restarted = SpikeDetector(cfg)
    assert run(restarted, losses[110:140], norms[110:140], first_step=111) == []
    assert [s.step for s in run(SpikeDetector(cfg), losses, norms)] == [121]


def test_a_step_checked_twice_is_judged_once_and_a_rewind_forgets_the_later_steps():
    detector = SpikeDetector(SpikeConfig(warmup_steps=0, window_steps=8))
    for step in range(1, 11):
        assert detector.observe(step, 2.0, 1.0) is None
        assert detector.observe(step, 2.0, 1.0) is None  # checked before a save, then reported
    assert [s for s, _ in detector.history["loss"]] == list(range(3, 11))
    detector.rewound(6)
    assert [s for s, _ in detector.history["loss"]] == [3, 4, 5, 6] and detector.judged == 6


# --- real runs ---

STEPS = 400


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory):
    """Learnable text (the standard library's docstrings, bytes) and a dataset of random bytes."""
    from engine.prepare.options import Options
    from engine.prepare.pipeline import prepare
    from testkit import corpus

    root = tmp_path_factory.mktemp("spikes")
    rng = random.Random(0)
    noise = ["".join(chr(rng.randrange(0x21, 0x2ff)) for _ in range(400)) for _ in range(40)]
    for name, texts, val in (("text", corpus.docstrings(600), 0.1), ("noise", noise, 0.0)):
        src = corpus.write(root / f"{name}.jsonl", texts, "jsonl")
        prepare(Options(inputs=(str(src),), tokenizer="bytes", out=str(root / name), workers=1, progress=False,
                        val_fraction=val))
    return root


def spike_job(tiny_spec, data, *overrides):
    return tiny_spec(*data, "model.vocab_size=264", "data.seq_len=128", "data.micro_batch_size=1",
                     f"train.max_steps={STEPS}", "train.log_interval=10", "scheduler.warmup_steps=10",
                     "checkpoint.interval_steps=5", "checkpoint.keep=2", "eval.batches=16",
                     "health.max_rollbacks=100", "health.spikes.warmup_steps=50", *overrides)


@pytest.mark.slow
@pytest.mark.in_process
def test_random_windows_are_caught_rolled_back_skipped_and_a_replay_with_the_ledger_is_bitwise(
        tiny_spec, tmp_path, poisoned):
    """One window in fifty is random bytes (a mixture; a step is one window). Every step after the
    warm-up that holds one is a spike, caught at its own step, rolled back in place (no restart) and its batch skipped;
    no other step is; the validation loss ends no more than 2 % above a run on the text alone; and a run from
    scratch given the ledger's ranges in data.skip ends with bitwise the same weights."""
    mixture = (f"data.mixture=[{{dataset: {poisoned / 'text'}, weight: 0.98}}, "
               f"{{dataset: {poisoned / 'noise'}, weight: 0.02}}]",)
    healed = Trainer(spike_job(tiny_spec, mixture), tmp_path / "healed", script := Recorder())
    assert healed.run() == exit_codes.OK
    # Which global samples (one a micro-batch, one micro-batch a step) are random.
    which, _ = healed.loader.samples.blend(np.arange(2 * STEPS))

    def poisoned_batch(index: int) -> bool:
        return bool(which[index] == 1)

    rolled = script.of(events.RolledBack)
    assert len(rolled) >= 3 and all(e.verdict == "data" and e.kind == "spike" for e in rolled)
    # Each was caught at its own step: the micro-batch that step had (the one skipped) is random...
    assert all(poisoned_batch(e.skip[0]) and e.skip[1] == 1 and e.step > 50 for e in rolled)
    # ...and after the warm-up, the run trained on no random window.
    assert not [s for s in range(50, STEPS) if poisoned_batch(healed.loader.index(s, 0))]
    ledger = healed.ledger.summary()["entries"]
    assert [(e["first"], e["reason"]) for e in ledger] == [(e.skip[0], "spike") for e in rolled]

    text = Trainer(spike_job(tiny_spec, (f"data.dataset={poisoned / 'text'}",)), tmp_path / "text", clean := Recorder())
    assert text.run() == exit_codes.OK
    final, reference = script.of(events.Eval)[-1].loss, clean.of(events.Eval)[-1].loss
    # No worse than the text alone (within 2 %): the skips shift which samples later steps see, so
    # the healed run may also end lower (on some CPUs 7 % lower, on the code before this check too).
    assert final <= reference * 1.02, (final, reference)

    ranges = ", ".join(f"[{e['samples'][0]}, {e['samples'][1]}]" for e in ledger)
    again = Trainer(spike_job(tiny_spec, mixture, f"data.skip=[{ranges}]", "health.spikes=null"), tmp_path / "again",
                    replayed := Recorder())
    assert again.run() == exit_codes.OK and not replayed.of(events.RolledBack)
    for (name, mine), theirs in zip(healed.model.state_dict().items(), again.model.state_dict().values()):
        assert torch.equal(mine, theirs), name


QUICK = ("train.max_steps=40", "train.log_interval=5", "scheduler.warmup_steps=1", "data.micro_batch_size=2",
         "data.seq_len=32", "checkpoint.interval_steps=5", "health.spikes.warmup_steps=10",
         "health.spikes.window_steps=16")


@pytest.mark.in_process
def test_an_injected_spike_is_rolled_back_skipped_and_its_time_counted(tiny_spec, tmp_path):
    run = Trainer(tiny_spec(*QUICK, "debug.inject.spike_at_step=23"), tmp_path, script := Recorder())
    assert run.run() == exit_codes.OK
    (event,) = script.of(events.RolledBack)
    # Found when step 25's save read steps 21-25; back to the save at 20; 21-23 replayed, 23 spiking again.
    assert (event.step, event.kind, event.restored_step, event.verdict) == (23, "spike", 20, "data")
    assert event.skip == (22, 1) and event.redone_steps == 3 and "loss" in event.reason
    assert run.loader.skips == ((22, 1),) and script.of(events.Step)[-1].badput.rollback > 0
    assert sorted(script.losses) == list(range(1, 41))


@pytest.mark.in_process
def test_a_spike_that_a_replay_does_not_reproduce_is_the_hardware_and_nothing_is_skipped(
        tiny_spec, tmp_path, monkeypatch):
    from engine.health import faults

    real, seen = faults.Faults.poison, set()

    def once(self, index):  # a transient fault: this micro-batch goes wrong the first time only
        factor = real(self, index)
        if factor != 1.0 and index in seen:
            return 1.0
        seen.add(index)
        return factor

    monkeypatch.setattr(faults.Faults, "poison", once)
    run = Trainer(tiny_spec(*QUICK, "debug.inject.spike_at_step=23"), tmp_path, script := Recorder())
    assert run.run() == exit_codes.OK
    (event,) = script.of(events.RolledBack)
    assert (event.step, event.verdict, event.skip, event.samples) == (23, "hardware", None, None)
    assert run.loader.skips == () and run.ledger.entries == []


@pytest.mark.in_process
def test_past_max_rollbacks_the_job_fails_with_the_reason_instead_of_looping(tiny_spec, tmp_path):
    run = Trainer(tiny_spec(*QUICK, "debug.inject.spike_at_step=[18, 28]", "health.max_rollbacks=1"), tmp_path,
                  script := Recorder())
    assert run.run() == exit_codes.NONFINITE_LOSS
    assert [e.step for e in script.of(events.RolledBack)] == [18]
    (stop,) = script.of(events.NonFinite)
    assert stop.step == 27 and stop.policy == "stop" and stop.skip is None  # step 28's batch, one skip earlier
    assert stop.reason.startswith("1 rollbacks within 1000 steps (health.max_rollbacks); then loss spike")
