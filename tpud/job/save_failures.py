"""Checkpoint saves that keep failing, per tier: what `tpud status` warns about.

A failed save does not stop training (the next interval tries again), so without a warning
a full disk would go unnoticed until the job needs a checkpoint it does not have. A
streak ends with the next commit on that tier. Torch-free: the daemon's side.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Streak:
    count: int     # failures in a row
    step: int | None
    error: str     # the last one's reason
    at: float      # wall time of the last one


class SaveFailures:
    def __init__(self, clock: Callable[[], float] = time.time):
        self.clock = clock
        self.streaks: dict[str, Streak] = {}  # tier -> the failures since its last commit

    def failed(self, tier: str, error: str, step: int | None) -> None:
        streak = self.streaks.get(tier)
        count = (streak.count if streak else 0) + 1
        self.streaks[tier] = Streak(count, step, error, self.clock())

    def committed(self, tier: str) -> None:
        self.streaks.pop(tier, None)

    def warnings(self) -> list[str]:
        """One line per failing tier, e.g. 'local checkpoint failed 3 times in a row, last at step 40
        12s ago: No space left on device (ENOSPC); training continues, the next save tries again'."""
        lines = []
        for tier, s in sorted(self.streaks.items()):
            times = "once" if s.count == 1 else f"{s.count} times in a row"
            step = "" if s.step is None else f" at step {s.step}"
            ago = max(0, round(self.clock() - s.at))
            then = "training continues and the next save tries again" if tier in ("local", "memory") else "it is retried"
            lines.append(f"{tier} checkpoint failed {times}, last{step} {ago}s ago: {s.error}; {then}")
        return lines

    def snapshot(self) -> dict[str, dict]:
        return {tier: {"count": s.count, "step": s.step, "error": s.error, "at_unix": round(s.at, 3)}
                for tier, s in self.streaks.items()}
