"""What the worker tells its supervisor, and what the supervisor asks of it: one type per message.

Each message is a frozen dataclass; on the channel (tpud/worker/channel.py) it travels as one
JSON line, `{"type": NAME, ...its fields}`. `decode` turns a line's object back into its type,
validated (pydantic), or None for anything this version does not know: the daemon then never
looks at a field that was not sent. Lists that other modules need (the badput kinds the
worker reports, the scalars that go to wandb) are read from these types, not retyped.

Torch-free: both the worker and the daemon import this.
"""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import Any, ClassVar

from pydantic import ConfigDict, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass

from engine.requests import Action, Request

_CONFIG = ConfigDict(extra="ignore")  # a newer worker may send more fields than we know


@dataclass(frozen=True, config=_CONFIG)
class Badput:
    """Seconds a worker process has spent not training, by kind, since it began (cumulative)."""

    startup: float = 0.0     # construction (less restore) and the first step (XLA compiles there)
    restore: float = 0.0     # loading and verifying the checkpoint resumed from
    checkpoint: float = 0.0  # the loop blocked by saves (all of a sync save, staging of an async one)
    data: float = 0.0        # fetching batches on the host and moving them to the device
    eval: float = 0.0        # validation loss (eval.batches micro-batches without gradients)
    rollback: float = 0.0    # healing a bad step in place: restores and replays (engine.health.healing)


BADPUT_KINDS = tuple(f.name for f in dataclasses.fields(Badput))


class Event:
    """A message on the channel. `TYPE` names it on the wire."""

    TYPE: ClassVar[str]

    def to_json(self) -> dict[str, Any]:
        return {"type": self.TYPE, **dataclasses.asdict(self)}


@dataclass(frozen=True, config=_CONFIG)
class Hello(Event):
    """The worker's first message. The rank says whether this host logs the job to wandb (rank 0)."""

    TYPE: ClassVar[str] = "hello"
    pid: int
    rank: int = 0


@dataclass(frozen=True, config=_CONFIG)
class Heartbeat(Event):
    """About once a second, from inside the loop: it is alive and where it is."""

    TYPE: ClassVar[str] = "heartbeat"
    step: int
    micro_step: int = 0


@dataclass(frozen=True, config=_CONFIG)
class Started(Event):
    """The training loop begins at `step`: startup and restore are behind it."""

    TYPE: ClassVar[str] = "started"
    step: int
    micro_step: int = 0
    badput: Badput = Badput()


@dataclass(frozen=True, config=_CONFIG)
class Step(Event):
    """A finished optimizer step's values, sent every log_interval steps once they reach the host."""

    TYPE: ClassVar[str] = "step"
    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens_per_s: float
    step_time_s: float
    mfu: float | None = None
    rss_bytes: int | None = None
    device_memory_bytes: int | None = None  # this process's peak device memory
    device_memory_in_use_bytes: int | None = None
    compilations: int | None = None  # graphs this process compiled so far (xla, or torch.compile)
    compile_seconds: float | None = None  # ... and the seconds they took
    badput: Badput = Badput()
    # A mixture of experts' routers (engine.models.moe.STATS); None for a dense model.
    aux_loss: float | None = None          # the load-balancing loss, before its coefficient
    z_loss: float | None = None            # the router z-loss, before its coefficient
    expert_load_max: float | None = None   # the busiest expert's share of its layer's choices (even: 1/experts)
    expert_load_cv: float | None = None    # the shares' coefficient of variation, mean over layers (even: 0)
    dropped_fraction: float | None = None  # of the choices, those beyond their expert's capacity
    # A distillation's terms (engine.losses.distill.TERMS); None without a teacher.
    distill_divergence: float | None = None  # the divergence from the teacher, times T^2, before (1 - alpha)
    distill_ce: float | None = None          # the hard-label cross-entropy, before alpha (reported at alpha 0 too)
    distill_hidden: float | None = None      # distill.hidden's mean squared error, before its weight (engine.distill.hidden)
    # Each auto checkpoint tier's policy (engine.checkpoint.policy.Interval.as_dict): tier -> steps, seconds,
    # save_seconds, disruptions_per_hour, expected_loss_seconds. None when no tier is auto.
    checkpoint_intervals: dict[str, dict[str, int | float | None]] | None = None
    # The local tier's interval in seconds as the worker's schedule applies it (the nearer of
    # interval_seconds and the step interval); None when neither is set.
    checkpoint_interval_s: float | None = None


# The host-side scalars of a step: what goes to wandb.
STEP_SCALARS = tuple(f.name for f in dataclasses.fields(Step) if f.name not in ("step", "badput", "checkpoint_intervals"))


@dataclass(frozen=True, config=_CONFIG)
class _Save(Event):
    """A save of the state at (step, micro_step), and why it was taken (interval, request, final)."""

    step: int
    micro_step: int
    reason: str


@dataclass(frozen=True, config=_CONFIG)
class CheckpointStarted(_Save):
    TYPE: ClassVar[str] = "checkpoint_started"
    blocking_s: float = 0.0  # how long the loop was held for it (staging an async save)
    tier: str = "local"
    waits: bool = True  # the loop waits for the write (a sync save, a final one): its silence is no hang


@dataclass(frozen=True, config=_CONFIG)
class CheckpointCommitted(_Save):
    TYPE: ClassVar[str] = "checkpoint_committed"
    path: str = ""
    bytes: int = 0
    seconds: float = 0.0
    tier: str = "local"  # local (its host's part, with several), or memory


@dataclass(frozen=True, config=_CONFIG)
class CheckpointFailed(_Save):
    TYPE: ClassVar[str] = "checkpoint_failed"
    error: str = ""
    failures: int = 1  # in a row, this one included
    path: str = ""
    tier: str = "local"


@dataclass(frozen=True, config=_CONFIG)
class CheckpointRestored(Event):
    TYPE: ClassVar[str] = "checkpoint_restored"
    step: int
    micro_step: int
    path: str
    seconds: float = 0.0


@dataclass(frozen=True, config=_CONFIG)
class Eval(Event):
    """The validation loss after `step`: the mean over the same eval.batches micro-batches every time."""

    TYPE: ClassVar[str] = "eval"
    step: int
    loss: float
    perplexity: float
    seconds: float


@dataclass(frozen=True, config=_CONFIG)
class NonFinite(Event):
    """A bad step (its loss or gradient norm not finite, or a spike) the worker could not heal in
    place, or may not (too many rollbacks, health.nonfinite stop): it exits 76 next."""

    TYPE: ClassVar[str] = "nonfinite"
    step: int
    loss: float
    grad_norm: float | None
    policy: str                       # rollback (the restart skips the step) | stop
    skip: tuple[int, int] | None = None  # for a rollback: the micro-batches (first, count) skipped from now on
    reason: str = ""                  # what was wrong, in a line


@dataclass(frozen=True, config=_CONFIG)
class RolledBack(Event):
    """The worker healed a bad step in place (engine.health.healing) and trains on."""

    TYPE: ClassVar[str] = "rolled_back"
    step: int                          # the bad step
    kind: str                          # spike | nonfinite
    reason: str                        # what was wrong, in a line
    restored_step: int                 # the state it went back to
    verdict: str                       # data (skipped) | hardware (not reproduced on replay: nothing skipped)
    skip: tuple[int, int] | None       # the micro-batches (first, count) skipped from now on
    samples: tuple[int, int] | None    # the same as samples (first, count)
    redone_steps: int                  # steps trained again: their first training was lost
    seconds: float


@dataclass(frozen=True, config=_CONFIG)
class ReplicaMismatch(Event):
    """The data-parallel replicas' states differ (engine.health.replicas); unless `healed`, the
    worker exits 79 (this replica is odd: quarantined) or 77 (the gang starts again from
    `agreed_step`) next."""

    TYPE: ClassVar[str] = "replica_mismatch"
    step: int
    agreed_step: int                 # the last step all replicas held the same state at
    rank: int                        # this process's (its host's, in a gang)
    odd: list[int]                   # the ranks named (quarantined); [] when none is
    fingerprints: list[str]          # by rank, hex
    reason: str
    found_by: str = ""               # "majority", "replay" (two replicas, or no majority), "" when none named
    healed: bool = False             # none named and the replay agreed: training went on in place


@dataclass(frozen=True, config=_CONFIG)
class Straggler(Event):
    """A process (a host, in a gang) was flagged a straggler, or cleared (engine.health.stragglers);
    every process reports the same judgement. With health.stragglers.evict, a flagged one is
    evicted: it exits 79 and the others 77 after a save."""

    TYPE: ClassVar[str] = "straggler"
    step: int
    straggler: int                   # the straggler's rank (its host, in a gang)
    rank: int                        # this process's
    ratio: float                     # its forward time over the others' median, this step
    flagged: bool                    # False: it kept under the factor for as long again: cleared
    evicted: bool
    reason: str


@dataclass(frozen=True, config=_CONFIG)
class Gang(Event):
    """A job on several hosts: the worker's view of its gang, while it waits for the others and
    once the gang has formed (`members` set: every host, or with gang.min_hosts those not left out). A new generation is a new gang: every restart
    of any host's worker starts one."""

    TYPE: ClassVar[str] = "gang"
    host: int
    hosts: int
    present: int
    generation: int
    members: list[int] | None = None  # once formed: the hosts in it (fewer than hosts: some left out)
    missing: list[int] | None = None  # while waiting: the hosts it waits for (neither seated nor excused)
    coordinator: str | None = None  # the coordinator it meets in (HOST:PORT)
    path: str | None = None  # once formed: in_place (this worker kept its process) or restart


@dataclass(frozen=True, config=_CONFIG)
class CheckpointRequest(Event):
    """The daemon asks the worker to act at its next boundary (engine.requests.Request on the wire)."""

    TYPE: ClassVar[str] = "request"
    action: Action
    deadline_s: float | None = None

    @classmethod
    def of(cls, request: Request) -> CheckpointRequest:
        return cls(request.action, request.deadline_s)

    def request(self) -> Request:
        return Request(self.action, self.deadline_s)

    def to_json(self) -> dict[str, Any]:
        return {"type": self.TYPE, "action": self.action.value, "deadline_s": self.deadline_s}


WORKER_EVENTS: tuple[type[Event], ...] = (Hello, Heartbeat, Started, Step, CheckpointStarted, CheckpointCommitted,
                                         CheckpointFailed, CheckpointRestored, Eval, NonFinite, RolledBack, ReplicaMismatch,
                                         Straggler, Gang)
_BY_TYPE = {cls.TYPE: cls for cls in (*WORKER_EVENTS, CheckpointRequest)}


@cache
def _adapter(cls: type[Event]) -> TypeAdapter:
    return TypeAdapter(cls)


def decode(message: object) -> Event | None:
    """A channel message as its type; None when it is not one this version knows (or is malformed)."""
    if not isinstance(message, dict):
        return None
    kind = message.get("type")
    cls = _BY_TYPE.get(kind) if isinstance(kind, str) else None  # a list or a dict would not even hash
    if cls is None:
        return None
    try:
        return _adapter(cls).validate_python({k: v for k, v in message.items() if k != "type"})
    except ValidationError:
        return None
