"""The auto checkpoint interval (engine.checkpoint.policy) and the schedule that follows it, with
injected costs and an injected clock; and one real run whose memory tier follows its policy."""

from __future__ import annotations

import math

import pytest

from engine import events
from engine.checkpoint.policy import DisruptionRate, IntervalPolicy, SecondsPolicy
from engine.checkpoint.schedule import SaveSchedule
from engine.spec.schema import CheckpointConfig
from engine.train import Trainer
from testkit.recorders import Recorder


def decided(save_s: float, per_hour: float, step_s: float = 0.05, **bounds) -> int:
    policy = IntervalPolicy(per_hour, **bounds)
    for _ in range(3):
        policy.step_took(step_s)
        policy.save_took(save_s)
    return policy.interval().steps


def test_the_interval_is_youngs_for_the_measured_cost_and_rate():
    # T* = sqrt(2 C / r): a 10 ms save at one disruption an hour is 8.5 s, 170 steps of 50 ms.
    assert decided(0.010, 1.0) == round(math.sqrt(2 * 0.010 * 3600) / 0.05)
    policy = IntervalPolicy(1.0)
    policy.step_took(0.05)
    policy.save_took(0.010)
    interval = policy.interval()
    assert interval.seconds == pytest.approx(interval.steps * 0.05)
    assert interval.expected_loss_seconds == pytest.approx(interval.seconds / 2 + 0.010)


def test_a_state_ten_times_larger_saves_about_sqrt_ten_times_less_often():
    ratio = decided(0.080, 2.0) / decided(0.008, 2.0)
    assert ratio == pytest.approx(math.sqrt(10), rel=0.3)


def test_disruptions_four_times_as_frequent_halve_the_interval():
    assert decided(0.010, 1.0) / decided(0.010, 4.0) == pytest.approx(2.0, rel=0.3)


def test_the_bounds_hold_whatever_the_model_says():
    # Frequent disruptions and a cheap save would save every step; max_overhead keeps saves under 5 %.
    assert decided(0.010, 3600.0, max_overhead=0.05) == round(0.010 / 0.05 / 0.05)  # 0.2 s of steps
    assert decided(0.0001, 3600.0, min_steps=7) == 7
    assert decided(1.0, 0.01, max_seconds=60.0) == 60 / 0.05  # rare disruptions: at most a minute of steps
    # Until a save has been measured, it saves after the fewest steps allowed, to measure one.
    assert IntervalPolicy(1.0, min_steps=3).interval().steps == 3


def test_the_disruption_rate_starts_at_the_prior_and_follows_what_is_seen():
    rate = DisruptionRate(prior_per_hour=1.0)
    assert rate.per_hour(0, 0) == 1.0
    assert rate.per_hour(0, 9 * 3600) == pytest.approx(0.1)  # ten quiet hours: one in ten
    assert rate.per_hour(39, 9 * 3600) == pytest.approx(4.0)  # 39 restarts in 9 h, with the prior's one
    with pytest.raises(ValueError):
        DisruptionRate(0)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class OneProcess:
    class data:
        world = 1


def test_the_schedule_saves_at_the_policys_interval_counted_from_the_last_save():
    clock = Clock()
    cfg = CheckpointConfig.model_validate({"interval_steps": "auto", "memory": {"interval_steps": "auto"}})
    schedule = SaveSchedule(cfg, OneProcess, disruptions_per_hour=3600.0, clock=clock)
    saves = {"local": [], "memory": []}
    for step in range(1, 200):
        clock.now += 0.05  # a 50 ms step
        schedule.step_done()
        if schedule.due(step):
            clock.now += 0.02  # a disk save holds the loop 20 ms
            schedule.saved(step, 0.02)
            saves["local"].append(step)
        elif schedule.memory_due(step):
            started = clock.now
            clock.now += 0.004
            schedule.memory_saved(step, started)
            saves["memory"].append(step)
    intervals = schedule.intervals()
    # sqrt(2 C / r) at one disruption a second: local sqrt(0.04) = 0.2 s (max_overhead: 0.4 s), 8 steps;
    # memory sqrt(0.008) = 0.089 s (max_overhead: 0.08 s), 2 steps.
    assert (intervals["local"].steps, intervals["memory"].steps) == (8, 2)
    assert saves["local"][0] == 1 and saves["memory"][0] == 2  # the first of each measures its cost
    assert set(b - a for a, b in zip(saves["local"][3:], saves["local"][4:])) == {8}
    assert intervals["memory"].disruptions_per_hour == 3600.0


def test_explicit_intervals_keep_their_meaning():
    cfg = CheckpointConfig.model_validate({"interval_steps": 5, "memory": {"interval_steps": 2}})
    schedule = SaveSchedule(cfg, OneProcess, clock=Clock())
    assert [s for s in range(1, 12) if schedule.due(s)] == [5, 10]
    assert [s for s in range(1, 7) if schedule.memory_due(s)] == [2, 4, 6]
    assert schedule.intervals() == {}


@pytest.mark.slow
@pytest.mark.in_process
def test_under_the_daemon_the_memory_tier_follows_its_policy(tiny_spec, tmp_path, monkeypatch):
    """A real run whose memory tier is auto (the default), told a disruption rate as the daemon
    tells its workers: every interval it reports is Young's for the save cost and step time it
    measured, and its saves come at those intervals. (How the interval scales with the rate is the
    policy's own tests': here the costs are whatever this host measures.)"""
    from engine.runtime import Runtime

    per_hour = 3600.0
    told = Runtime.from_env({"TPUD_DISRUPTIONS_PER_HOUR": str(per_hour), "TPUD_MEMORY_DIR": str(tmp_path / "shm")})
    spec = tiny_spec("train.max_steps=120", "train.log_interval=1", "scheduler.warmup_steps=1", "data.seq_len=32",
                     "data.micro_batch_size=2", "checkpoint.interval_steps=0", "checkpoint.memory.max_overhead=1")
    assert spec.checkpoint.memory.interval_steps == "auto"
    hooks = Recorder()
    assert Trainer(spec, tmp_path, hooks, runtime=told).run() == 0
    steps = {e.step: e.checkpoint_intervals["memory"] for e in hooks.of(events.Step)}
    assert all(i["disruptions_per_hour"] == per_hour for i in steps.values())
    timed = [i for i in steps.values() if i["save_seconds"] and i["seconds"]]
    assert len(timed) > len(steps) // 2
    for i in timed:
        # sqrt(2 C / r), at least C (max_overhead 1), in whole steps (at least one) of the mean step time.
        young, step = max(math.sqrt(2 * i["save_seconds"] * 3600 / per_hour), i["save_seconds"]), i["seconds"] / i["steps"]
        assert abs(i["seconds"] - young) <= step / 2 + 2e-3 or (i["steps"] == 1 and young <= 1.5 * step + 2e-3), i
    # (the final disk save at 120 goes through the tier too, whatever its interval)
    saved = [c.step for c in hooks.of(events.CheckpointCommitted) if c.tier == "memory" and c.step < 120]
    assert saved[0] == 1 and len(saved) > 1  # the first measures a save
    for before, after in zip(saved, saved[1:]):
        # Each came once the interval in force had passed. Step `after`'s event reports the policy
        # the loop held at step after - 1, which found no save due: so never later than that interval.
        # The decision at `after` also weighed step `after`'s own time: a slow step (a loaded host)
        # shortens it, a step of rounding more at the smallest intervals; never to a fraction.
        assert steps[after]["steps"] / 2 - 1 <= after - before <= steps[after]["steps"], (saved, steps[after])


def test_the_daemon_hands_each_worker_the_rate_it_has_seen(tiny_spec, tmp_path):
    from tpud.gcs.tiers import CheckpointTiers
    from tpud.job.health.restarts import Restarts
    from tpud.paths import Paths

    spec, restarts = tiny_spec("checkpoint.disruptions_per_hour=2"), Restarts()
    assert restarts.disruptions_per_hour(spec, 0.0) == 2  # nothing seen: the prior
    for reason in ("crash", "hang", "killed"):
        assert restarts.crashed(spec, 0.0, reason) is not None
    restarts.peer()
    # Four restarts in an hour, with the prior's one disruption in half an hour: 5 / 1.5 h.
    rate = restarts.disruptions_per_hour(spec, 3600.0)
    assert rate == pytest.approx(5 / 1.5)
    # The worker gets it in its environment; the GCS tier's auto interval follows it too.
    spec = tiny_spec("checkpoint.remote=gs://bucket/ckpt", "checkpoint.remote_interval_seconds=auto")
    tiers = CheckpointTiers(spec, Paths.resolve(tmp_path), lambda *a: None)
    assert float(tiers.worker_env(rate)["TPUD_DISRUPTIONS_PER_HOUR"]) == pytest.approx(rate, rel=1e-5)
    tiers.uploader.interval.save_took(1.0)
    assert tiers.policy().disruptions_per_hour == rate
    assert tiers.policy().seconds == pytest.approx(math.sqrt(2 * 3600 / rate))


def test_the_gcs_tier_interval_follows_youngs_rule_in_seconds():
    policy = SecondsPolicy(1.0, max_seconds=3600.0, max_overhead=1.0)
    assert policy.interval().seconds == 0  # nothing measured: upload at once, and measure
    policy.save_took(10.0)
    first = policy.interval()
    assert first.seconds == pytest.approx(math.sqrt(2 * 10 * 3600)) and first.steps is None  # ~268 s
    assert first.expected_loss_seconds == pytest.approx(first.seconds / 2 + 10)
    bigger = SecondsPolicy(1.0, max_seconds=3600.0, max_overhead=1.0)
    bigger.save_took(100.0)
    assert bigger.interval().seconds / first.seconds == pytest.approx(math.sqrt(10))
    policy.disruptions_per_hour = 4.0
    assert first.seconds / policy.interval().seconds == pytest.approx(2)
    policy.disruptions_per_hour, policy.max_overhead = 3600.0, 0.05  # sqrt(2 x 10 / 1) = 4.5 s; 10 s at 5 %: 200 s
    assert policy.interval().seconds == pytest.approx(200)
    policy.max_seconds = 60
    assert policy.interval().seconds == 60


@pytest.mark.parametrize("value", ["-1", "true", "soon", "inf"])
def test_a_gcs_interval_that_is_neither_seconds_nor_auto_is_refused_naming_the_key(value):
    from engine.spec.loader import SpecError, load_spec
    from tests.conftest import TINY_JOB

    with pytest.raises(SpecError, match=r"checkpoint.remote_interval_seconds: must be a number of seconds"):
        load_spec(TINY_JOB, [f"checkpoint.remote_interval_seconds={value}"])
    assert load_spec(TINY_JOB, ["checkpoint.remote_interval_seconds=2.5"]).checkpoint.remote_interval_seconds == 2.5


@pytest.mark.parametrize("value", ["fast", "-1", "true", "1.5"])
def test_an_interval_that_is_neither_steps_nor_auto_is_refused_naming_the_key(value):
    from engine.spec.loader import SpecError, load_spec
    from tests.conftest import TINY_JOB

    for key in ("checkpoint.interval_steps", "checkpoint.memory.interval_steps"):
        with pytest.raises(SpecError, match=rf"{key}: must be a number of steps \(0: off\) or auto"):
            load_spec(TINY_JOB, [f"{key}={value}"])
    assert load_spec(TINY_JOB, ["checkpoint.interval_steps=auto"]).checkpoint.interval_steps == "auto"


def test_the_local_interval_in_seconds_is_the_nearer_of_the_step_and_time_intervals():
    """What the step event carries as checkpoint_interval_s (tpud_job_checkpoint_interval_seconds)."""
    for steps, seconds, expected in ((100, 0, 50.0), (100, 20, 20.0), (10, 20, 5.0), (0, 30, 30.0), (0, 0, None)):
        cfg = CheckpointConfig(interval_steps=steps, interval_seconds=seconds)
        assert SaveSchedule(cfg, OneProcess, clock=Clock()).local_interval_s(0.5) == expected, (steps, seconds)
    auto = SaveSchedule(CheckpointConfig.model_validate({"interval_steps": "auto"}), OneProcess, clock=Clock())
    assert auto.local_interval_s(0.5) == auto.intervals()["local"].seconds
