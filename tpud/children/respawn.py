"""When a helper process of the daemon that died is started again (torch-free).

The daemon's helpers (the job-file reader, the fork server, host 0's gang coordinator) die only
when something kills them: the OOM killer, an operator's `kill`. Each is started again once its
death is seen (the fork server: with the next worker wanted): at once when it had lived a while, after a growing backoff when it
keeps dying soon after its start (a broken installation, an address taken), so that a helper
which cannot live neither spins the CPU nor floods the journal.

Deaths are seen as events, never by polling: the loop's selector (or the reader's thread) waits
on a process's pidfd, or the fork server's socket, which becomes readable the moment it exits.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from engine.backoff import Backoff

BACKOFF = Backoff(initial=1.0, maximum=30.0)
SETTLED_S = 60.0  # a helper that lived this long died of something outside it: start it again at once


class Respawn:
    def __init__(self, clock: Callable[[], float] = time.monotonic, backoff: Backoff = BACKOFF,
                 settled_s: float = SETTLED_S):
        self.clock, self.backoff, self.settled_s = clock, backoff, settled_s
        self.failures = 0  # deaths in a row, each soon after its start
        self.due: float | None = None  # when the helper that died may start again (the clock's time)
        self._started = -float("inf")

    def started(self) -> None:
        self._started, self.due = self.clock(), None

    def died(self) -> float:
        """The helper died: seconds until it may start again."""
        now = self.clock()
        self.failures = 1 if now - self._started > self.settled_s else self.failures + 1
        self.due = self._started + self.backoff.delay(self.failures)
        return max(0.0, self.due - now)

    def ready(self) -> bool:
        """Whether it may start: never started, or its backoff is over."""
        return self.due is None or self.clock() >= self.due
