"""What the supervisor can ask of the training loop: checkpoint, checkpoint and exit, or stop.

Below both the loop's hooks (engine/hooks.py: polled for these at every boundary) and the
channel's messages (engine/events.py: CheckpointRequest carries one on the wire).
Torch-free: both the worker and the daemon import this.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Action(enum.Enum):
    CHECKPOINT = "checkpoint"                    # checkpoint, then continue
    CHECKPOINT_AND_EXIT = "checkpoint_and_exit"  # checkpoint, wait for the commit, exit 75
    STOP = "stop"                                # exit 75 without a checkpoint


@dataclass(frozen=True)
class Request:
    action: Action
    # None: act at the next step boundary. A number of seconds: act at the next step
    # boundary if the rest of the step fits in it, else at the next micro-batch boundary
    # (a partial-step checkpoint); 0 means the very next boundary.
    deadline_s: float | None = None


_STRENGTH = {Action.CHECKPOINT: 0, Action.CHECKPOINT_AND_EXIT: 1, Action.STOP: 2}


def merge(a: Request | None, b: Request | None) -> Request | None:
    """Two pending requests as one: the stronger action, the tighter deadline.

    A checkpoint asked for while a checkpoint-and-exit waits must not cancel the exit.
    """
    if a is None or b is None:
        return a or b
    action = max(a.action, b.action, key=_STRENGTH.__getitem__)
    deadlines = [d for d in (a.deadline_s, b.deadline_s) if d is not None]
    return Request(action, min(deadlines) if deadlines else None)
