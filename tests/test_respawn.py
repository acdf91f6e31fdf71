"""When a helper process that died starts again (tpud/children/respawn.py), with an injected clock."""

import pytest

from tpud.children.respawn import Respawn


def test_a_helper_that_lived_starts_again_at_once_and_one_that_keeps_dying_young_backs_off():
    now = [1000.0]
    respawn = Respawn(clock=lambda: now[0])
    assert respawn.ready() and respawn.due is None  # never started

    respawn.started()
    now[0] += 300  # a long life, then a kill from outside
    assert respawn.died() == 0 and respawn.ready()

    waits = []
    for _ in range(7):  # then it dies 0.5 s after each start: 1, 2, 4 ... s after that start, at most 30
        respawn.started()
        now[0] += 0.5
        waits.append(respawn.died())
        assert not respawn.ready()
        now[0] = respawn.due
        assert respawn.ready()
    assert waits == pytest.approx([1.5, 3.5, 7.5, 15.5, 29.5, 29.5, 29.5])

    respawn.started()
    now[0] += 61  # settled again: the streak is over
    assert respawn.died() == 0 and respawn.failures == 1
