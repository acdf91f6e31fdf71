"""When a silent worker counts as hung.

The bound on silence follows what is normal for this worker: the startup allowance until its
first steps are done (restore, compilation), then the larger of the heartbeat timeout and a
multiple of the median step time, and the checkpoint allowance while a blocking save is
written. Heartbeats come about once a second from inside the loop (channel.HeartbeatClock).
"""

from __future__ import annotations

import statistics
from collections import deque

from engine.spec.schema import HealthConfig


class HangWatch:
    def __init__(self, health: HealthConfig, now: float):
        self.health = health
        self.last_heard = now
        self.started_step: int | None = None  # where the worker's loop began
        self.step = 0                         # the latest step it reported
        self.step_times: deque[float] = deque(maxlen=64)
        self.saving_since: float | None = None  # a checkpoint is being written

    def new_worker(self, health: HealthConfig, now: float) -> None:
        """A worker starts: it restores and compiles first. The step times of earlier workers
        stay (the same job steps at the same pace), and so does the latest step."""
        self.health, self.last_heard = health, now
        self.started_step, self.saving_since = None, None

    def heard(self, now: float, step: int | None = None) -> None:
        self.last_heard = now
        if step is not None:
            self.step = step

    def loop_started(self, step: int) -> None:
        self.started_step = self.step = step

    def stepped(self, step: int, step_time_s: float) -> None:
        self.step = step
        self.step_times.append(step_time_s)

    def saving(self, now: float | None) -> None:
        """A save began (`now`), or None: it ended, or the loop runs on beside an async one."""
        self.saving_since = now

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
