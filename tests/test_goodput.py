"""The goodput ledger: every second of a job's life in exactly one bucket."""

import time

import pytest

from engine.events import Badput
from tpud.job.goodput import BACKOFF, DOWN, IDLE, WORKER, Ledger


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


def counters(startup=0.0, restore=0.0, checkpoint=0.0, data=0.0):
    return Badput(startup, restore, checkpoint, data)


@pytest.fixture
def clock():
    return Clock()


def ledger(clock, saved=None, wall=None, **kw):
    return Ledger(saved, clock=clock, wall=wall or clock, **kw)


def test_a_clean_run_splits_startup_restore_checkpoint_and_steps(clock):
    book = ledger(clock)
    book.enter(WORKER)
    clock.advance(10)  # interpreter, imports, trainer, restore of 2 s
    book.worker_started(0, counters(startup=5, restore=2))
    clock.advance(20)  # first step compiled (3 s), a checkpoint blocked 1 s, 0.5 s waiting for data
    book.worker_report(10, counters(startup=8, restore=2, checkpoint=1, data=0.5))
    assert book.badput["startup"] == pytest.approx(8 + 3)
    assert book.badput["restore"] == 2
    assert book.badput["checkpoint"] == 1 and book.badput["data"] == 0.5
    assert book.productive == pytest.approx(20 - 3 - 1 - 0.5)
    assert book.wall_seconds == pytest.approx(30)
    assert book.ratio == pytest.approx(15.5 / 30)


def test_a_crash_loses_its_unreported_time_and_the_steps_redone_after_restart(clock):
    book = ledger(clock)
    book.enter(WORKER)
    book.worker_started(0, counters())
    clock.advance(10)
    book.worker_report(10, counters())  # 1 s per step
    clock.advance(3)  # steps 11..13, never reported
    book.worker_exited(lost_work=True)
    assert book.badput["lost"] == 3
    book.enter(BACKOFF)
    clock.advance(2)
    book.enter(WORKER)
    clock.advance(1)
    book.worker_started(4, counters())  # resumed from the checkpoint at step 4: steps 5..10 are redone
    assert book.badput["backoff"] == 2
    assert book.badput["startup"] == 1
    assert book.badput["lost"] == pytest.approx(3 + 6)
    assert book.productive == pytest.approx(4)
    assert book.wall_seconds == pytest.approx(16)


def test_a_requested_stop_spends_its_tail_on_the_final_checkpoint(clock):
    book = ledger(clock)
    book.enter(WORKER)
    book.worker_started(0, counters())
    clock.advance(5)
    book.worker_report(5, counters())
    clock.advance(2)
    book.worker_exited(lost_work=False)
    assert book.badput["checkpoint"] == 2 and book.badput["lost"] == 0


def test_idle_time_is_not_counted_and_down_time_survives_a_daemon_restart(clock):
    book = ledger(clock)
    book.enter(IDLE)
    clock.advance(100)
    book.enter(DOWN)  # preempted: waiting for a host
    clock.advance(5)
    saved = book.to_dict()
    assert book.badput["down"] == 5 and book.wall_seconds == 5
    clock.advance(50)  # tpud is not running: the VM is being recreated
    again = ledger(clock, saved)
    assert again.badput["down"] == 55


def test_badput_is_reported_as_it_accrues(clock):
    seen = []
    book = ledger(clock, on_badput=lambda kind, seconds: seen.append((kind, seconds)))
    book.enter(BACKOFF)
    clock.advance(4)
    book.enter(WORKER)
    assert seen == [("backoff", 4)]


def test_a_jobs_badput_counters_go_on_from_its_saved_totals_counting_the_down_time_once(clock):
    counted = {}

    class Metrics:
        def badput(self, job, kind, seconds):
            counted[kind] = counted.get(kind, 0.0) + seconds

        def goodput(self, job, ratio):
            pass

    saved = {"productive": 10.0, "badput": {"down": 5.0, "lost": 2.0}, "phase": WORKER, "saved_unix": time.time() - 100}
    book = Ledger.for_job(saved, "j", Metrics(), clock)  # tpud was down for 100 s while the job meant to run
    assert book.badput["down"] == pytest.approx(105, abs=1) and counted["down"] == book.badput["down"]
    assert counted["lost"] == 2
    book.enter(BACKOFF)
    clock.advance(3)
    book.enter(IDLE)
    assert counted["backoff"] == 3 and set(counted) == set(book.badput)


def test_a_rollback_in_place_moves_the_rolled_back_steps_and_the_healing_to_rollback(clock):
    from engine.events import RolledBack

    book = ledger(clock)
    book.enter(WORKER)
    book.worker_started(0, counters())
    clock.advance(20)
    book.worker_report(20, counters())  # 1 s a step
    # A spike at step 20: back to step 16, 3 s of restoring and replaying.
    book.on_rolled_back(RolledBack(step=20, kind="spike", reason="loss spike", restored_step=16, verdict="data",
                                   skip=(19, 1), samples=(38, 2), redone_steps=4, seconds=3.0))
    assert book.badput["rollback"] == 4 and book.productive == 16
    clock.advance(3 + 4)
    book.worker_report(20, Badput(rollback=3.0))  # steps 17-20 trained again
    assert book.badput["rollback"] == 4 + 3 and book.productive == 16 + 4
    assert book.wall_seconds == pytest.approx(27)
