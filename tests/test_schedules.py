"""Step schedules: the learning rate (cosine, wsd, linear, constant) and the batch-size ramp."""

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from engine.backends.base import DataPosition
from engine.spec.schema import SchedulerConfig, TrainConfig
from engine.data.batch import Batch
from engine.data.loader import AccumSchedule
from testkit.recorders import array_loader
from engine import events
from engine.hooks import Boundary
from engine.optim.schedule import decay_start, lr_factor
from engine.spec.loader import SpecError, load_spec
from engine.train import Trainer
from testkit.recorders import Recorder


def factors(cfg, max_steps):
    return [lr_factor(cfg, s, max_steps) for s in range(max_steps)]


def non_increasing(xs):
    return all(a >= b for a, b in zip(xs, xs[1:]))


# --- learning rate ---


def test_cosine_schedule_boundaries():
    cfg = SchedulerConfig(warmup_steps=10, min_lr_ratio=0.1)
    assert lr_factor(cfg, 0, 100) == pytest.approx(0.1)  # first warmup step is not zero
    assert lr_factor(cfg, 9, 100) == pytest.approx(1.0)  # end of warmup reaches the peak
    assert lr_factor(cfg, 10, 100) == pytest.approx(1.0)  # decay starts from the peak
    assert lr_factor(cfg, 55, 101) == pytest.approx(0.55)  # halfway through decay: the midpoint
    assert lr_factor(cfg, 99, 100) == pytest.approx(0.1)  # last step sits on the floor
    assert non_increasing(factors(cfg, 100)[10:])


def test_schedule_without_warmup_starts_at_peak():
    for name in ("cosine", "linear"):
        cfg = SchedulerConfig(name=name, warmup_steps=0, min_lr_ratio=0.0)
        assert lr_factor(cfg, 0, 50) == pytest.approx(1.0)
        assert lr_factor(cfg, 49, 50) == pytest.approx(0.0)


def test_linear_schedule_boundaries():
    cfg = SchedulerConfig(name="linear", warmup_steps=10, min_lr_ratio=0.2)
    f = factors(cfg, 101)
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0) and f[10] == pytest.approx(1.0)
    assert f[55] == pytest.approx(0.6)  # halfway from 1 to 0.2
    assert f[100] == pytest.approx(0.2)
    steps = np.diff(f[10:])
    assert np.allclose(steps, steps[0]) and steps[0] < 0  # a straight line down
    assert f[:10] == sorted(f[:10])


@pytest.mark.parametrize("shape", ["1-sqrt", "linear"])
def test_wsd_warms_up_holds_then_decays_over_the_last_fraction(shape):
    cfg = SchedulerConfig(name="wsd", warmup_steps=10, min_lr_ratio=0.1, decay_fraction=0.2, decay_shape=shape)
    assert decay_start(cfg, 100) == 80  # exactly (1 - decay_fraction) of the steps
    f = factors(cfg, 100)
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)  # end of warmup
    assert f[9:80] == [1.0] * 71  # stable at the peak up to the decay start...
    assert f[80] < 1.0  # ...where the last 20 steps begin to decay
    assert f[99] == pytest.approx(0.1)  # last step on the floor
    assert f[:10] == sorted(f[:10]) and non_increasing(f[9:])
    remaining = 0.5 ** 0.5 if shape == "1-sqrt" else 0.5
    assert f[89] == pytest.approx(0.1 + 0.9 * (1 - remaining))  # 10 of the 20 decay steps done
    assert f[80] == pytest.approx(0.1 + 0.9 * (1 - (0.05 ** 0.5 if shape == "1-sqrt" else 0.05)))


def test_wsd_decay_start_for_fractions_that_do_not_divide_the_steps():
    cfg = SchedulerConfig(name="wsd", decay_fraction=0.3)
    assert decay_start(cfg, 10) == 7 and decay_start(cfg, 1000) == 700
    assert decay_start(SchedulerConfig(name="wsd", decay_fraction=0.29), 100) == 71  # float 28.999... rounds
    assert decay_start(SchedulerConfig(name="wsd", decay_fraction=1.0), 100) == 0
    assert decay_start(SchedulerConfig(name="wsd", decay_fraction=0.01), 20) == 19  # at least one step decays
    assert decay_start(SchedulerConfig(name="cosine", warmup_steps=10), 100) == 11
    assert decay_start(SchedulerConfig(name="constant"), 100) == 100


def test_wsd_decay_longer_than_the_stable_phase_is_capped_by_warmup():
    cfg = SchedulerConfig(name="wsd", warmup_steps=50, decay_fraction=0.8, min_lr_ratio=0.0)
    f = factors(cfg, 100)
    assert decay_start(cfg, 100) == 20  # inside the warmup
    peak = int(np.argmax(f))
    assert f[:peak + 1] == sorted(f[:peak + 1]) and non_increasing(f[peak:]) and f[-1] == pytest.approx(0.0)
    assert max(f) < 1.0 and all(a == pytest.approx((s + 1) / 50) for s, a in enumerate(f[:peak]))


def test_constant_warms_up_then_holds_the_peak():
    cfg = SchedulerConfig(name="constant", warmup_steps=4)
    assert factors(cfg, 10) == pytest.approx([0.25, 0.5, 0.75, 1, 1, 1, 1, 1, 1, 1])
    assert factors(SchedulerConfig(name="constant"), 3) == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("name", ["cosine", "linear", "wsd"])
def test_decaying_schedules_are_monotone_and_end_on_the_floor(name):
    for max_steps, warmup in ((2, 0), (7, 3), (50, 0), (333, 17)):
        cfg = SchedulerConfig(name=name, warmup_steps=warmup, min_lr_ratio=0.05)
        f = factors(cfg, max_steps)
        top = max(warmup, 1) - 1
        assert f[:top + 1] == sorted(f[:top + 1]) and non_increasing(f[top:])
        assert f[-1] == pytest.approx(0.05) and all(0.05 - 1e-12 <= x <= 1.0 for x in f)


@pytest.mark.parametrize(("fields", "key"), [
    ({"name": "constant", "min_lr_ratio": 0.1}, "min_lr_ratio"),  # even at the default value: set, so an error
    ({"name": "constant", "min_lr_ratio": 0.0}, "min_lr_ratio"),
    ({"name": "cosine", "decay_fraction": 0.1}, "decay_fraction"),
    ({"name": "linear", "decay_shape": "linear"}, "decay_shape"),
])
def test_a_key_the_schedule_does_not_use_is_an_error_naming_it(fields, key):
    with pytest.raises(ValidationError) as info:
        SchedulerConfig(**fields)
    [error] = info.value.errors()
    assert error["loc"] == (key,) and f"not used by the {fields['name']} schedule" in error["msg"]


def test_schedule_key_errors_are_located_in_the_job_file(tiny_spec):
    with pytest.raises(SpecError) as info:
        tiny_spec("scheduler.name=constant")  # tiny-cpu.yaml sets min_lr_ratio
    [problem] = info.value.problems
    assert problem.key == "scheduler.min_lr_ratio" and "tiny-cpu.yaml" in problem.file and problem.line
    spec = tiny_spec("scheduler={name: wsd, warmup_steps: 5, decay_fraction: 0.1}")
    assert (spec.scheduler.name, spec.scheduler.decay_fraction, spec.scheduler.min_lr_ratio) == ("wsd", 0.1, 0.1)


# --- batch-size ramp ---

RAMP = AccumSchedule(final=4, stages=((3, 1), (5, 2), (6, 3)))


def brute_force(schedule, step):
    return sum(schedule.at(s) for s in range(step))


def test_accumulation_per_step_follows_the_ramp():
    assert [RAMP.at(s) for s in range(9)] == [1, 1, 1, 2, 2, 3, 4, 4, 4]
    assert [AccumSchedule(3).at(s) for s in range(3)] == [3, 3, 3]


@pytest.mark.parametrize("schedule", [RAMP, AccumSchedule(1), AccumSchedule(5), AccumSchedule(7, ((100, 2),)),
                                      AccumSchedule(8, ((1, 1), (2, 2), (10, 4), (37, 6)))])
def test_micro_batches_before_a_step_is_the_sum_of_the_steps_before(schedule):
    assert [schedule.before(s) for s in range(120)] == [brute_force(schedule, s) for s in range(120)]


def test_ramp_stages_must_ascend():
    for stages in (((3, 1), (3, 2)), ((0, 1),), ((5, 1), (2, 2)), ((3, 0),)):
        with pytest.raises(ValueError, match="ascending"):
            AccumSchedule(4, stages)


TOKENS = np.arange(8 * 97, dtype=np.int64)  # 97 windows of 8 distinct tokens: epochs do not divide evenly


def window_ids(batch):
    return (batch.inputs[:, 0] // 8).tolist()


def test_loader_positions_are_contiguous_across_a_ramp_change():
    loader = array_loader(TOKENS, seq_len=7, micro_batch_size=3, accum=RAMP, seed=0)
    flat = array_loader(TOKENS, seq_len=7, micro_batch_size=3, accum=1, seed=0)
    # Every micro-batch of the ramped run, in order, is the next micro-batch of one flat stream.
    ramped = [loader.batch(step, m) for step in range(12) for m in range(RAMP.at(step))]
    assert len(ramped) == RAMP.before(12) == 3 + 4 + 3 + 6 * 4
    for g, batch in enumerate(ramped):
        assert batch == flat.batch(g, 0)
    # Non-overlapping: the first epoch's 97 windows are each seen once before any repeats.
    seen = [w for batch in ramped for w in window_ids(batch)]
    assert sorted(seen[:97]) == list(range(97)) and len(set(seen[:97])) == 97
    with pytest.raises(IndexError):
        loader.batch(3, 2)  # step 3 has two micro-batches


def test_ranks_and_micro_batches_partition_the_global_batch_under_a_ramp():
    ramp = AccumSchedule(2, ((2, 1),))
    one = array_loader(TOKENS, 7, 1, 1, seed=3)  # sample g of the run is one.batch(g, 0)
    ranks = [array_loader(TOKENS, 7, 2, ramp, 3, DataPosition(rank=r, world=2)) for r in range(2)]
    for step in range(5):
        # The step's global batch: micro-batches x ranks x 2 samples, right after the previous step's.
        first, n = ramp.before(step) * 2 * 2, ramp.at(step) * 2 * 2
        expected = Batch.cat([one.batch(g, 0) for g in range(first, first + n)])
        parts = [ranks[r].batch(step, m) for m in range(ramp.at(step)) for r in range(2)]
        assert Batch.cat(parts) == expected


def test_tokens_in_steps_counts_each_steps_micro_batches():
    loader = array_loader(TOKENS, seq_len=7, micro_batch_size=3, accum=RAMP, seed=0)
    assert loader.tokens_in_steps(0, 3) == 3 * 1 * 3 * 7
    assert loader.tokens_in_steps(2, 7) == (1 + 2 + 2 + 3 + 4) * 3 * 7
    assert loader.tokens_in_steps(4, 4) == 0


def ramp_config(*stages, final=4, max_steps=100):
    return TrainConfig(max_steps=max_steps, grad_accum_steps=final,
                       batch_ramp=[{"until_step": u, "grad_accum_steps": a} for u, a in stages])


def test_ramp_config_builds_the_schedule():
    train = ramp_config((3, 1), (5, 2), (6, 3))
    assert AccumSchedule.of(train) == RAMP
    assert AccumSchedule.of(TrainConfig(grad_accum_steps=2)) == AccumSchedule(2)


@pytest.mark.parametrize(("stages", "final", "loc", "message"), [
    (((10, 1), (10, 2)), 4, ("batch_ramp", 1, "until_step"), "must exceed the previous stage's until_step (10)"),
    (((10, 1), (5, 2)), 4, ("batch_ramp", 1, "until_step"), "must exceed the previous stage's until_step (10)"),
    (((10, 1), (200, 2)), 4, ("batch_ramp", 1, "until_step"), "must not exceed train.max_steps (100)"),
    (((10, 8),), 4, ("batch_ramp", 0, "grad_accum_steps"), "must not exceed train.grad_accum_steps (4)"),
    (((10, 3), (20, 2)), 4, ("batch_ramp", 1, "grad_accum_steps"), "must not be below the previous stage's (3)"),
])
def test_ramp_config_errors_name_the_key(stages, final, loc, message):
    with pytest.raises(ValidationError) as info:
        ramp_config(*stages, final=final)
    [error] = info.value.errors()
    assert error["loc"] == loc and message in error["msg"]


def test_ramp_errors_are_located_in_the_job_file(tiny_spec):
    with pytest.raises(SpecError) as info:
        tiny_spec("train.grad_accum_steps=2", "train.batch_ramp=[{until_step: 5, grad_accum_steps: 1},"
                  " {until_step: 4, grad_accum_steps: 3}]")
    assert sorted(p.key for p in info.value.problems) == [
        "train.batch_ramp.1.grad_accum_steps", "train.batch_ramp.1.until_step"]
    with pytest.raises(SpecError) as info:
        tiny_spec("train.batch_ramp=[{until_step: 5}]")
    assert [p.key for p in info.value.problems] == ["train.batch_ramp.0.grad_accum_steps"]  # required


def test_trainer_runs_each_steps_micro_batches_under_a_ramp(tiny_spec, tmp_path):
    spec = tiny_spec("train.max_steps=5", "scheduler.warmup_steps=1", "train.log_interval=5",
                     "data.seq_len=32", "data.micro_batch_size=2", "train.grad_accum_steps=3",
                     "train.batch_ramp=[{until_step: 2, grad_accum_steps: 1}, {until_step: 3, grad_accum_steps: 2}]")
    hooks = Recorder()
    trainer = Trainer(spec, tmp_path, hooks)
    seconds = []
    real_report = trainer.reporter.report
    trainer.reporter.report = lambda pending, s: (seconds.append(s), real_report(pending, s))
    assert trainer.run() == 0 and trainer.step == 5
    assert hooks.boundaries == [Boundary(s, m) for s, n in enumerate([1, 1, 2, 3, 3]) for m in range(n)]
    steps = hooks.of(events.Step)
    assert [e.step for e in steps] == [1, 2, 3, 4, 5]
    # One report for all five steps: 10 micro-batches of 2 x 32 tokens in the interval.
    assert steps[0].tokens_per_s == pytest.approx(10 * 2 * 32 / seconds[0], rel=1e-3)


def test_wsd_decay_longer_than_the_steps_after_warmup_is_an_error(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("name: j\ntrain:\n  max_steps: 100\nscheduler:\n  name: wsd\n  warmup_steps: 50\n"
                   "  decay_fraction: 0.6\n")
    with pytest.raises(SpecError) as info:
        load_spec(job)
    assert f"{job}:7: scheduler.decay_fraction: decays over 60 steps, more than the 50 left" in str(info.value)
