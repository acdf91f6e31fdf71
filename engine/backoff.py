"""Exponential backoff, as one value: how long to wait before a retry. Torch-free.

Used for restarting crashed workers, retrying GCS uploads and metadata-server reads, and
retrying a final checkpoint that failed. Jitter spreads retries of many hosts apart.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    initial: float        # seconds before the first retry
    maximum: float        # no wait is longer
    factor: float = 2.0   # each retry waits this much longer than the one before
    jitter: float = 0.0   # a wait is drawn uniformly from (1 - jitter) x .. x the step

    def __post_init__(self) -> None:
        if not (self.initial >= 0 and self.maximum >= 0 and self.factor >= 1 and 0 <= self.jitter <= 1):
            raise ValueError(f"invalid backoff {self}")

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """The wait before retry number `attempt` (1 for the first)."""
        step = min(self.maximum, self.initial * self.factor ** min(max(attempt, 1) - 1, 64))
        if not self.jitter:
            return step
        return (rng or random).uniform(step * (1 - self.jitter), step)
