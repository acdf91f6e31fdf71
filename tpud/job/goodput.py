"""Goodput: how much of a job's wall time went into training steps that were kept.

Every second from the job's first start is put in exactly one bucket: productive, or one
of the badput kinds below. The supervisor tells the ledger which phase the job is in and
hands it the worker's own counters (engine/train.py reports startup, restore, checkpoint
and data time, cumulative per process, in its `started` and `step` events); the ledger
takes differences. What the worker cannot see is settled here:

- before its `started` event, the worker is starting up (interpreter, imports, restore);
- after its last report, a worker that crashed or hung did work that is lost, and one
  that was asked to stop was writing its final checkpoint;
- steps done after the checkpoint a restarted worker resumes from were redone: their time
  moves from productive to lost; steps a worker rolled back in place (a bad step healed,
  engine.health.healing), from productive to rollback, beside the worker's own rollback time.

Time the job is not meant to run (held by the operator, finished) is not counted; time
it waits for a host (preempted, or tpud itself not running) is `down`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from engine import events

WORKER_KINDS = events.BADPUT_KINDS  # what the worker reports
KINDS = (*WORKER_KINDS, "lost", "backoff", "down")

# Phases, each with the bucket its time goes to; "worker" is split by the worker's reports.
IDLE, WORKER, BACKOFF, DOWN = "idle", "worker", "backoff", "down"
_PHASE_KIND = {BACKOFF: "backoff", DOWN: "down"}


class Ledger:
    def __init__(self, saved: dict | None = None, *, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, on_badput: Callable[[str, float], None] | None = None,
                 on_ratio: Callable[[float], None] | None = None):
        """on_badput(kind, seconds) for each addition to a badput kind; on_ratio(ratio) after each step event."""
        saved = saved or {}
        self.clock, self.wall, self.on_badput = clock, wall, on_badput or (lambda kind, seconds: None)
        self.on_ratio = on_ratio or (lambda ratio: None)
        self.on_useful_mfu: Callable[[float], None] = lambda ratio: None
        self.mfu: float | None = None  # the worker's last report of it: goodput x MFU is the useful compute
        self.productive: float = saved.get("productive", 0.0)
        self.badput: dict[str, float] = {k: saved.get("badput", {}).get(k, 0.0) for k in KINDS}
        self.phase = IDLE
        self._mark = clock()
        self._worker: dict | None = None  # the current worker's baseline counters and progress
        self._steps_reached = saved.get("steps_reached", 0)
        self._per_step = saved.get("per_step", 0.0)  # productive seconds per step, for lost steps
        # A job that was meant to run when tpud last saw it waited for its host meanwhile.
        if saved.get("phase", IDLE) != IDLE and saved.get("saved_unix"):
            self._add("down", max(0.0, self.wall() - saved["saved_unix"]))

    @classmethod
    def for_job(cls, saved: dict | None, job: str, metrics, clock: Callable[[], float]) -> Ledger:
        """A job's ledger, its badput and goodput in `metrics`, whose counters go on from the saved totals."""
        ledger = cls(saved, clock=clock, on_ratio=lambda ratio: metrics.goodput(job, ratio))
        for kind, seconds in ledger.badput.items():  # the down time it just booked is in these once
            metrics.badput(job, kind, seconds)
        ledger.on_badput = lambda kind, seconds: metrics.badput(job, kind, seconds)
        ledger.on_useful_mfu = lambda ratio: metrics.useful_mfu(job, ratio)
        return ledger

    # --- what the supervisor tells us ---

    def enter(self, phase: str) -> None:
        """The job moves to a phase: idle, worker, backoff or down."""
        self._settle()
        if phase == WORKER:
            self._worker = {"counters": None, "start_step": None, "productive": 0.0, "started": False}
        self.phase = phase

    def worker_started(self, step: int, badput: events.Badput) -> None:
        """The worker's loop began at `step`: before this it was starting up."""
        if self._worker is None:
            return
        counters = dataclasses.asdict(badput)
        elapsed = self._elapsed()
        restore = float(counters.get("restore", 0.0))
        self._add("restore", restore)
        self._add("startup", max(0.0, elapsed - restore))
        self._worker.update(counters=dict(counters), start_step=step, started=True)
        # Steps past the checkpoint this worker resumed from were done before and are redone now.
        if self._steps_reached > step:
            self._lose((self._steps_reached - step) * self._per_step)
        self._steps_reached = step

    def worker_report(self, step: int, badput: events.Badput) -> None:
        """A `step` event: the worker's cumulative badput counters at `step`."""
        w = self._worker
        if w is None or not w["started"]:
            return
        counters = dataclasses.asdict(badput)
        elapsed = self._elapsed()
        spent = 0.0
        for kind in WORKER_KINDS:
            delta = max(0.0, float(counters.get(kind, 0.0)) - float(w["counters"].get(kind, 0.0)))
            self._add(kind, delta)
            spent += delta
        productive = max(0.0, elapsed - spent)  # the rest of the worker's time went into steps
        self.productive += productive
        w["productive"] += productive
        w["counters"] = dict(counters)
        self._steps_reached = max(self._steps_reached, step)
        if step > w["start_step"]:
            self._per_step = w["productive"] / (step - w["start_step"])

    def on_rolled_back(self, event: events.RolledBack) -> None:
        """The worker went back to event.restored_step in place: the later steps' time was spent for nothing."""
        if self._worker is None or not self._worker["started"]:
            return
        self._lose(max(0, self._steps_reached - event.restored_step) * self._per_step, "rollback")
        self._steps_reached = event.restored_step

    def on_started(self, event: events.Started) -> None:
        self.worker_started(event.step, event.badput)

    def on_step(self, event: events.Step) -> None:
        self.worker_report(event.step, event.badput)
        self.mfu = event.mfu
        if self.ratio is not None:
            self.on_ratio(self.ratio)
            if self.mfu is not None:
                self.on_useful_mfu(self.ratio * self.mfu)

    def worker_exited(self, lost_work: bool) -> None:
        """The worker is gone: its unreported time was lost work, or its final checkpoint."""
        if self._worker is not None:
            seconds = self._elapsed()
            if not self._worker["started"]:
                self._add("startup", seconds)
            else:
                self._add("lost" if lost_work else "checkpoint", seconds)
        self._worker = None
        self.phase = IDLE

    # --- reading ---

    @property
    def wall_seconds(self) -> float:
        return self.productive + sum(self.badput.values())

    @property
    def ratio(self) -> float | None:
        wall = self.wall_seconds
        return self.productive / wall if wall > 0 else None

    def snapshot(self) -> dict:
        useful = None if self.ratio is None or self.mfu is None else round(self.ratio * self.mfu, 4)
        return {"ratio": None if self.ratio is None else round(self.ratio, 4), "useful_mfu": useful,
                "productive_seconds": round(self.productive, 3), "wall_seconds": round(self.wall_seconds, 3),
                "badput_seconds": {k: round(v, 3) for k, v in self.badput.items()}}

    def to_dict(self) -> dict:
        self._settle()
        return {"productive": self.productive, "badput": dict(self.badput), "phase": self.phase,
                "steps_reached": self._steps_reached, "per_step": self._per_step, "saved_unix": self.wall()}

    # --- internals ---

    def _elapsed(self) -> float:
        now = self.clock()
        elapsed, self._mark = max(0.0, now - self._mark), now
        return elapsed

    def _settle(self) -> None:
        """Book the time since the last mark to the current phase (idle time is dropped)."""
        if self.phase == WORKER:
            return  # the worker's reports and its exit settle its time
        elapsed = self._elapsed()
        if self.phase in _PHASE_KIND:
            self._add(_PHASE_KIND[self.phase], elapsed)

    def _add(self, kind: str, seconds: float) -> None:
        if seconds > 0:
            self.badput[kind] += seconds
            self.on_badput(kind, seconds)

    def _lose(self, seconds: float, kind: str = "lost") -> None:
        """Productive time that turned out wasted, moved to `kind`."""
        seconds = min(seconds, self.productive)
        self.productive -= seconds
        self._add(kind, seconds)
