"""The worker's badput: seconds this process has spent not training, by kind (events.Badput).

The supervisor's goodput accounting sees restarts and lost steps from outside; only the
worker can tell how long it spent starting, restoring, blocked by checkpoints and fetching
data. Every `step` event carries the totals so far.

Startup is counted in phases: from construction until the trainer is ready, and again from
the start of the loop until its first step is done (under XLA the first step compiles). Time
inside a phase that another kind counted (the restore, the first batch's fetch, a save at the
first boundary) is that kind's, not startup's: each second is counted once.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from engine import events


class Badput:
    def __init__(self) -> None:
        self.seconds = dict.fromkeys(events.BADPUT_KINDS, 0.0)
        self._startup_since: tuple[float, float] | None = None  # (clock, other kinds' seconds) at its start
        self.startup_begins()

    @contextlib.contextmanager
    def timing(self, kind: str) -> Iterator[None]:
        """Count the block's time as `kind`."""
        started = time.monotonic()
        try:
            yield
        finally:
            self.seconds[kind] += time.monotonic() - started

    def startup_begins(self) -> None:
        self._startup_since = (time.monotonic(), self._others())

    def startup_ends(self) -> None:
        """End the startup phase begun last; with none open (every step after the first) a no-op."""
        if self._startup_since is None:
            return
        began, others = self._startup_since
        self.seconds["startup"] += max(0.0, time.monotonic() - began - (self._others() - others))
        self._startup_since = None

    def snapshot(self) -> events.Badput:
        return events.Badput(**{kind: round(seconds, 3) for kind, seconds in self.seconds.items()})

    def _others(self) -> float:
        return sum(seconds for kind, seconds in self.seconds.items() if kind != "startup")
