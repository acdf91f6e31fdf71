"""A job's states, their groups, and the transitions between them (docs/architecture.md, "Job lifecycle").

    PENDING -> STARTING -> RUNNING -> SUCCEEDED
                             |  |--> CHECKPOINTING -> RUNNING
                             |  |--> STOPPING -> STOPPED        (tpud stop, file removed, shutdown)
                             |  |--> STOPPING -> PREEMPTED      (preemption notice; waits for the host)
                             |  '--> BACKOFF -> STARTING        (crash, hang, non-finite loss rollback)
                             '--> FAILED                         (restart budget spent, exit 76/78)

Dependency-free, so the metrics module and the CLI name the states from here. Every change of
state is checked against TRANSITIONS: a move the table does not list is a bug in the job's
logic, raised at once rather than left to show up as a job stuck in an odd state.
"""

from __future__ import annotations

import enum


class State(str, enum.Enum):
    PENDING = "PENDING"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    CHECKPOINTING = "CHECKPOINTING"
    STOPPING = "STOPPING"
    STOPPED = "STOPPED"
    PREEMPTED = "PREEMPTED"
    BACKOFF = "BACKOFF"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"


ACTIVE = frozenset({State.STARTING, State.RUNNING, State.CHECKPOINTING, State.STOPPING})  # a worker is there
ENDED = frozenset({State.STOPPED, State.PREEMPTED, State.SUCCEEDED, State.FAILED})  # none, and none coming by itself
WAITING = frozenset({State.PENDING, State.BACKOFF})  # none yet, one coming by itself
TRAINING = frozenset({State.RUNNING, State.CHECKPOINTING})  # a worker whose loop runs: it can checkpoint

_S = State
# A crash (or an internal error handled as one) may end any state in a backoff or, with the
# restart budget spent, in FAILED: those two are reachable from everywhere.
_ANYWHERE = {_S.BACKOFF, _S.FAILED}
TRANSITIONS: dict[State, frozenset[State]] = {s: frozenset(targets | _ANYWHERE) for s, targets in {
    _S.PENDING: {_S.STARTING, _S.STOPPED, _S.PREEMPTED},
    _S.STARTING: {_S.RUNNING, _S.STOPPING, _S.STOPPED, _S.PREEMPTED, _S.SUCCEEDED},
    _S.RUNNING: {_S.CHECKPOINTING, _S.STOPPING, _S.STARTING, _S.SUCCEEDED},
    _S.CHECKPOINTING: {_S.RUNNING, _S.STOPPING, _S.STARTING, _S.SUCCEEDED},
    _S.STOPPING: {_S.STOPPED, _S.PREEMPTED, _S.STARTING, _S.SUCCEEDED},
    _S.BACKOFF: {_S.STARTING, _S.STOPPED, _S.PREEMPTED},
    _S.STOPPED: {_S.STARTING},
    _S.PREEMPTED: {_S.STARTING},
    _S.SUCCEEDED: {_S.STARTING},
    _S.FAILED: {_S.STARTING},
}.items()}


class InvalidTransition(RuntimeError):
    pass


def check(old: State, new: State) -> None:
    """Raise InvalidTransition unless TRANSITIONS allows old -> new."""
    if new not in TRANSITIONS[old]:
        raise InvalidTransition(f"{old.value} -> {new.value} is not a job state transition")
