"""The training loop's window to the outside: polled at every boundary, told every event.

engine never imports tpud; the daemon's worker implements this interface (requests from
the supervisor, heartbeats and checkpoint events back to it). The defaults do nothing,
which is what `python -m engine.train` uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from engine.requests import Action, Request, merge

if TYPE_CHECKING:
    from engine.events import Event


@dataclass(frozen=True)
class Boundary:
    step: int        # optimizer steps completed
    micro_step: int  # micro-batches of the current step completed (0 at a step boundary)


class Hooks:
    def poll(self, at: Boundary) -> Request | None:
        """Called at every micro-batch and step boundary; return a request to act on."""
        return None

    def emit(self, event: Event) -> None:
        """Step metrics, checkpoint events, the start of the loop (engine/events.py)."""

    def on_request(self, answer: Callable[[Request], bool]) -> None:
        """Have `answer` called from another thread as soon as a request arrives, before the
        loop's next boundary; when it returns True the request is answered and not polled.
        Hooks that hear requests only when polled never call it."""


class SignalHooks(Hooks):
    """The signal fallback (docs/architecture.md, "The worker channel"): SIGTERM = checkpoint
    then exit, SIGUSR1 = checkpoint and continue, both at the very next boundary. Handlers only
    record; the loop acts."""

    def __init__(self, early: Iterable[int] = ()) -> None:
        """early: signals a handler of the process's own recorded before these hooks existed."""
        import signal

        self._pending: Request | None = None
        self._actions = {signal.SIGTERM: Action.CHECKPOINT_AND_EXIT, signal.SIGUSR1: Action.CHECKPOINT}
        for signum in self._actions:
            signal.signal(signum, lambda signum, _frame: self._record(signum))
        for signum in list(early):  # after the handlers: one arriving meanwhile is not lost
            self._record(signum)

    def _record(self, signum: int) -> None:
        self._pending = merge(self._pending, Request(self._actions[signum], deadline_s=0.0))

    def poll(self, at: Boundary) -> Request | None:
        request, self._pending = self._pending, None
        return request
