"""The training loop's window to the outside: polled at every boundary, told every event.

engine never imports tpud; the daemon's worker implements this interface (requests from
the supervisor, heartbeats and checkpoint events back to it). The defaults do nothing,
which is what `python -m engine.train` uses.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Request(enum.Enum):
    CHECKPOINT = "checkpoint"            # checkpoint, then continue
    CHECKPOINT_AND_EXIT = "checkpoint_and_exit"
    STOP = "stop"                        # exit without a checkpoint


@dataclass(frozen=True)
class Boundary:
    step: int        # optimizer steps completed
    micro_step: int  # micro-batches of the current step completed (0 at a step boundary)


class Hooks:
    def poll(self, at: Boundary) -> Request | None:
        """Called at every micro-batch and step boundary; return a request to act on."""
        return None

    def emit(self, event: str, **fields) -> None:
        """Step metrics, checkpoint events, start and exit notices."""
