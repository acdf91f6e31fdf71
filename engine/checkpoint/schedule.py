"""When the loop saves: a disk checkpoint every interval_steps steps and once interval_seconds
have passed since the last save (`due`), and a memory one every memory.interval_steps steps
while its saves stay within their share of the loop's time (`memory_due`).
"""

from __future__ import annotations

import time

from engine.backends.base import Backend
from engine.requests import Action, Request
from engine.spec.schema import CheckpointConfig


class SaveSchedule:
    def __init__(self, cfg: CheckpointConfig, backend: Backend):
        self.cfg, self.backend = cfg, backend
        self.last_save_time = time.monotonic()
        self._memory_budget: tuple[float | None, float] = (None, 0.0)  # (first memory save, seconds they held the loop)

    def due(self, step: int) -> bool:
        """Whether an interval checkpoint is due now, `step` steps done; every rank gets the same answer."""
        by_steps = self.cfg.interval_steps and step % self.cfg.interval_steps == 0
        by_time = self.cfg.interval_seconds and time.monotonic() - self.last_save_time >= self.cfg.interval_seconds
        if self.cfg.interval_seconds and not by_steps:
            # Each rank reads its own clock: they agree, or one rank alone would enter the save's collectives.
            by_time = self.backend.agree(Request(Action.CHECKPOINT) if by_time else None) is not None
        return bool(by_steps or by_time)

    def saved(self) -> None:
        """A disk save was staged now: the time interval starts again."""
        self.last_save_time = time.monotonic()

    def memory_due(self, step: int) -> bool:
        """Whether the memory tier saves at this step: every interval_steps steps, while the time
        its saves held the loop stays within max_overhead of the time since the first. No
        collective: each host's tier is its own."""
        if step % self.cfg.memory.interval_steps:
            return False
        since, spent = self._memory_budget
        return since is None or spent <= self.cfg.memory.max_overhead * (time.monotonic() - since)

    def memory_saved(self, started: float) -> None:
        """A memory save that began at `started` (time.monotonic()) has given the loop back."""
        since, spent = self._memory_budget
        self._memory_budget = (since or started, spent + time.monotonic() - started)
