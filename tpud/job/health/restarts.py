"""When a crashed job may start again: its restart budget, and the backoff before each restart.

A job may crash at most restart.max_restarts times within restart.window_seconds; past that it
fails. Each restart waits an exponential backoff whose exponent is the crash streak: the crashes
since a worker last committed a checkpoint, so a job that makes progress between rare crashes
never backs off for long. Non-finite-loss rollbacks have their own budget (health.max_rollbacks)
and restart at once; so does a micro-batch found too large (engine.fitting), whose sizes only shrink.
A gang refusing a job because its hosts' copies of the job file differ waits for them to agree:
every CONVERGE_WAIT_S, for CONVERGE_FOR_S at most, without spending the budget. Under the daemon
the copies change seconds apart: remote_jobs' hosts each fetch a change within their own poll, an
operator copies a file to one host after another, and a host that was paused (or whose daemon
was down) reads it last. Under `tpud run` the operator is watching: it fails at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine import events
from engine.backoff import Backoff
from engine.checkpoint.policy import DisruptionRate
from engine.spec.fingerprint import HOSTS_DIFFER
from engine.spec.schema import JobSpec

CONVERGE_WAIT_S = 10.0  # between tries while the job file's copies differ: twice remote_jobs' default poll
CONVERGE_FOR_S = 120.0  # ... and how long they may differ before the job fails


@dataclass
class Restarts:
    total: int = 0      # every restart, crash or rollback: persisted (job.json), shown in status
    rollbacks: int = 0  # non-finite-loss rollbacks: persisted, their budget never resets
    crash_times: deque[float] = field(default_factory=deque)  # clock times, within the window
    streak: int = 0     # crashes since a worker last committed a checkpoint: the backoff's exponent
    reasons: dict[str, int] = field(default_factory=dict)  # this daemon's restarts, by reason: for status
    on_restart: Callable[[str], None] = lambda reason: None  # each restart's reason, as it is counted
    differing_since: float | None = None  # since when the gang's copies of the job file differ

    def copies_differ(self, error: str, watched: bool, now: float) -> float | None:
        """An exit 78 with `error`: seconds until the next try when the gang's hosts hold other
        versions of a job file the daemon watches (they agree once each has its copy), else None
        (it fails)."""
        if not watched or HOSTS_DIFFER not in error:
            return None
        self.differing_since = now if self.differing_since is None else self.differing_since
        return CONVERGE_WAIT_S if now - self.differing_since <= CONVERGE_FOR_S else None

    def crashed(self, spec: JobSpec, now: float, reason: str) -> float | None:
        """A crash at `now`: seconds to wait before the restart, or None when the budget is spent."""
        policy = spec.restart
        while self.crash_times and now - self.crash_times[0] > policy.window_seconds:
            self.crash_times.popleft()
        if len(self.crash_times) >= policy.max_restarts:
            return None
        self.crash_times.append(now)
        self.streak += 1
        self._restart(reason)
        return Backoff(policy.backoff_initial_seconds, policy.backoff_max_seconds).delay(self.streak)

    def budget_spent_reason(self, spec: JobSpec) -> str:
        return f"restart budget spent ({len(self.crash_times)} restarts within {spec.restart.window_seconds:.0f}s)"

    def rollback(self, spec: JobSpec) -> bool:
        """A non-finite loss: whether a rollback is left (and, if so, it is counted)."""
        if self.rollbacks >= spec.health.max_rollbacks:
            return False
        self.rollbacks += 1
        self._restart("nonfinite")
        return True

    def nonfinite(self, spec: JobSpec, what: str, rollback: bool) -> tuple[bool, str, str]:
        """An exit 76 (`what`; `rollback`: the worker recorded the batches to skip): whether the job
        rolls back (a rollback is left, and is counted), its error, and the reason of its state."""
        if rollback and self.rollback(spec):
            return True, what, f"{what}; rollback {self.rollbacks} of {spec.health.max_rollbacks}"
        spent = f"; {self.rollbacks} rollbacks spent" if rollback else ""
        return False, what + spent, f"exit 76: {what}{spent}"

    def peer(self) -> None:
        """Another host's worker failed and the gang restarts: counted, but no crash of this host's."""
        self._restart("peer")

    def refit(self) -> None:
        """The micro-batch did not fit and a smaller one is recorded (engine.fitting): at once, no crash."""
        self._restart("refit")

    def _restart(self, reason: str) -> None:
        self.total += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        self.on_restart(reason)

    def disruptions_per_hour(self, spec: JobSpec, seconds: float) -> float:
        """What the auto checkpoint intervals assume: every restart counted over the job's `seconds`
        so far, weighed with its prior (checkpoint.disruptions_per_hour)."""
        return DisruptionRate(spec.checkpoint.disruptions_per_hour).per_hour(self.total, seconds)

    def on_step(self, event: events.Step) -> None:
        """The gang trained a step, so its copies of the job file agreed: a later difference is
        waited for afresh."""
        self.differing_since = None

    def on_checkpoint_committed(self, event: events.CheckpointCommitted) -> None:
        """The worker made progress: its crashes are not a crash loop."""
        self.streak = 0
