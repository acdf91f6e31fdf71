"""engine.backoff.Backoff: the one exponential backoff every retry loop uses."""

import random

import pytest

from engine.backoff import Backoff


def test_doubles_from_the_initial_wait_up_to_the_cap():
    assert [Backoff(0.5, 5.0).delay(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert Backoff(1.0, 10.0, factor=3).delay(3) == 9.0
    assert Backoff(2.0, 1.0).delay(1) == 1.0  # a cap below the first wait wins, as restart policies allow
    assert Backoff(1.0, 30.0).delay(10_000) == 30.0  # no overflow however long it fails


def test_jitter_draws_from_a_share_of_the_step():
    rng = random.Random(0)
    waits = [Backoff(4.0, 60.0, jitter=0.5).delay(2, rng) for _ in range(200)]
    assert all(4.0 <= w <= 8.0 for w in waits) and max(waits) - min(waits) > 2


@pytest.mark.parametrize("kwargs", [dict(initial=-1, maximum=1), dict(initial=1, maximum=2, factor=0.5),
                                    dict(initial=1, maximum=2, jitter=2)])
def test_nonsense_is_refused(kwargs):
    with pytest.raises(ValueError):
        Backoff(**kwargs)
