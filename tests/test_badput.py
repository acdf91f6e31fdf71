"""The worker's badput accumulator: each second counted once, as one kind."""

import pytest

from engine import badput as badput_module
from engine import events
from engine.badput import Badput


@pytest.fixture
def clock(monkeypatch):
    class Clock:
        now = 100.0

        def __call__(self):
            return self.now

    fake = Clock()
    monkeypatch.setattr(badput_module.time, "monotonic", fake)
    return fake


def test_a_startup_phase_excludes_what_other_kinds_counted_inside_it(clock):
    badput = Badput()  # the first startup phase begins at construction
    clock.now += 2
    with badput.timing("restore"):
        clock.now += 5
    clock.now += 1
    badput.startup_ends()
    assert badput.snapshot() == events.Badput(startup=3, restore=5)

    clock.now += 50  # between the phases: nobody's badput
    badput.startup_begins()  # the loop's first step
    with badput.timing("data"):
        clock.now += 0.25
    with badput.timing("checkpoint"):
        clock.now += 4
    clock.now += 10
    badput.startup_ends()
    assert badput.snapshot() == events.Badput(startup=13, restore=5, checkpoint=4, data=0.25)


def test_only_the_first_step_ends_a_phase(clock):
    badput = Badput()
    badput.startup_ends()
    badput.startup_begins()
    clock.now += 1
    badput.startup_ends()
    clock.now += 1
    badput.startup_ends()  # every later step: nothing more is startup
    assert badput.snapshot().startup == 1


def test_a_block_that_raises_still_counts(clock):
    badput = Badput()
    with pytest.raises(OSError), badput.timing("checkpoint"):
        clock.now += 0.0004
        raise OSError("disk full")
    assert badput.seconds["checkpoint"] == pytest.approx(0.0004)
    assert badput.snapshot().checkpoint == 0.0  # reported rounded to milliseconds
