"""When a silent worker counts as hung.

The bound on silence follows what is normal for this worker: the startup allowance until its
first steps are done (restore, compilation), then the larger of the heartbeat timeout and a
multiple of the median step time, and the checkpoint allowance while a blocking save is
written. Heartbeats come about once a second from inside the loop (channel.HeartbeatClock).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable

from engine import events
from engine.spec.schema import HealthConfig


class HangWatch:
    def __init__(self, health: HealthConfig, clock: Callable[[], float]):
        self.health, self.clock = health, clock
        self.last_heard = clock()
        self.started_step: int | None = None  # where the worker's loop began
        self.step = 0                         # the latest step it reported
        self.step_times: deque[float] = deque(maxlen=64)
        self.saving_since: float | None = None  # a checkpoint is being written

    def new_worker(self, health: HealthConfig) -> None:
        """A worker starts: it restores and compiles first. The step times of earlier workers
        stay (the same job steps at the same pace), and so does the latest step."""
        self.health, self.last_heard = health, self.clock()
        self.started_step, self.saving_since = None, None

    def heard(self, step: int | None = None) -> None:
        self.last_heard = self.clock()
        if step is not None:
            self.step = step

    # --- the worker's events (tpud/job/routing.py) ---

    def on_hello(self, event: events.Hello) -> None:
        self.heard()
        self.saving_since = None  # the loop runs on: an async save needs no allowance

    def on_heartbeat(self, event: events.Heartbeat) -> None:
        self.heard(event.step)
        self.saving_since = None

    def on_started(self, event: events.Started) -> None:
        self.started_step = self.step = event.step

    def on_step(self, event: events.Step) -> None:
        self.step = event.step
        self.step_times.append(event.step_time_s)

    def on_checkpoint_started(self, event: events.CheckpointStarted) -> None:
        # The loop waits for a blocking disk save only: an async one (or the memory tier's) gives
        # a worker that stops right after it no longer allowance than any other.
        if event.tier != "memory" and event.waits:
            self.saving_since = self.clock()

    def on_checkpoint_committed(self, event: events.CheckpointCommitted | events.CheckpointFailed) -> None:
        if event.tier != "memory":
            self.saving_since = None

    on_checkpoint_failed = on_checkpoint_committed  # the save is over either way

    # --- reading ---

    def bound(self) -> float:
        """Seconds of silence after which the worker counts as hung."""
        health = self.health
        if self.started_step is None or self.step < self.started_step + health.startup_steps:
            return health.startup_timeout_seconds  # restore and compilation
        bound = health.heartbeat_timeout_seconds
        if self.step_times:
            bound = max(bound, health.hang_step_multiple * statistics.median(self.step_times))
        if self.saving_since is not None:
            bound = max(bound, health.checkpoint_timeout_seconds)
        return bound

    def deadline(self) -> float:
        """The clock time at which the worker is hung unless heard from again."""
        return self.last_heard + self.bound()

    def verdict(self, now: float) -> str | None:
        """Why the worker is hung at `now`, or None."""
        silent, bound = now - self.last_heard, self.bound()
        if silent <= bound:
            return None
        return f"hung: no heartbeat for {silent:.0f}s (bound {bound:.0f}s) after step {self.step}"
