"""Stragglers (health.stragglers): the rule on seeded step times, the slow-host fault, and real
data-parallel processes, one of them slowed down."""

from __future__ import annotations

import random
import time

import pytest

from engine.health.faults import Faults
from engine.health.stragglers import TOLERANCE, StragglerJudge
from engine.spec.schema import InjectConfig
from testkit.helpers import committed, data_parallel


def noisy(rng: random.Random, ranks: int, slow: dict[int, float] | None = None) -> list[float]:
    """One step's forward times: 40 ms with the jitter of a busy machine (about 10 %)."""
    return [0.04 * rng.lognormvariate(0, 0.1) * (slow or {}).get(rank, 1.0) for rank in range(ranks)]


@pytest.mark.parametrize("ranks", [2, 3, 8])
def test_a_rank_1_5x_slower_is_flagged_within_20_steps_and_cleared_within_20_after(ranks):
    rng, judge = random.Random(ranks), StragglerJudge(factor=1.5, steps=20)
    for _ in range(100):
        assert judge.observe(noisy(rng, ranks)) == []
    changes = [judge.observe(noisy(rng, ranks, {1: 1.5})) for _ in range(40)]
    flagged = [i for i, c in enumerate(changes) if c]
    # Once most of the window is slow, and for a tenth of a window after: within the 20 slow steps.
    assert len(flagged) == 1 and 12 <= flagged[0] <= 19
    ((rank, ratio, flag),) = changes[flagged[0]]
    assert rank == 1 and flag and ratio == pytest.approx(1.5, rel=0.1)
    cleared = [judge.observe(noisy(rng, ranks)) for _ in range(40)]
    assert [(c[0][0], c[0][2]) for c in cleared if c] == [(1, False)]
    assert next(i for i, c in enumerate(cleared) if c) < 20


def test_no_flag_in_a_thousand_clean_steps_nor_for_a_rank_only_1_3x_slower():
    rng = random.Random(0)
    for ranks, slow in ((2, None), (3, None), (4, {3: 1.3})):
        judge = StragglerJudge(factor=1.5, steps=20)
        assert [c for _ in range(1000) for c in judge.observe(noisy(rng, ranks, slow))] == []


def test_a_burst_of_slow_steps_shorter_than_the_window_is_no_straggler():
    judge = StragglerJudge(factor=1.5, steps=20)
    times = [[1.0, 9.0 if 30 <= i < 39 else 1.0] for i in range(100)]  # 9 stalled steps in a window of 20
    assert [c for t in times for c in judge.observe(t)] == []
    judge.reset()  # a rollback: the redone steps are judged afresh, from a full window, for 2 steps
    assert all(judge.observe([1.0, 2.0]) == [] for _ in range(20)) and judge.observe([1.0, 2.0])


def test_the_slow_host_fault_slows_only_its_rank_from_its_step(tmp_path):
    from engine.data.loader import AccumSchedule

    faults = Faults(InjectConfig(slow_host={"rank": 1, "factor": 3, "from_step": 5}), tmp_path, AccumSchedule(1))

    def slept(step: int, rank: int) -> float:
        began = time.monotonic()
        faults.slow_down(step, rank, 0.02)
        return time.monotonic() - began

    assert slept(5, 1) >= 0.04 and slept(9, 1) >= 0.04
    assert slept(4, 1) < 0.01 and slept(5, 0) < 0.01


@pytest.mark.slow
def test_a_slowed_process_is_flagged_and_evicted_after_a_save(tmp_path):
    # Rank 1 runs 4x slower from its 9th step; flagged once most of an 8-step window is slow (step 13,
    # give or take the timing noise of a busy machine). Every rank saves that step, then rank 1 exits
    # 79 (evicted) and rank 0 77. The judge's factor is 2.5, not the default 1.5: beside the other test
    # lane on 2 cores, one of two ranks sharing them ran a median 1.5x the other's for 8 steps unslowed.
    ranks = data_parallel(tmp_path, 2, "debug.inject.slow_host={rank: 1, factor: 4, from_step: 8}",
                          "health.stragglers={steps: 8, evict: true, factor: 2.5}", steps=30)
    assert [r["exit"] for r in ranks] == [77, 79]
    step = ranks[0]["stragglers"][0]["step"]
    assert 10 <= step <= 16  # after the slowdown began, within the window
    for rank, report in enumerate(ranks):
        (event,) = report["stragglers"]
        assert (event["straggler"], event["rank"], event["flagged"], event["evicted"]) == (1, rank, True, True)
        # Flagged at the factor less the judge's allowance for timing noise (once in CI: 2.483).
        assert event["step"] == step and event["ratio"] >= TOLERANCE * 2.5
        assert report["steps"][-1] == step
    assert committed(tmp_path / "checkpoints" / "tiny-cpu")[-1] == (step, 0)
