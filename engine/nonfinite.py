"""The non-finite guard (job spec `health.nonfinite`): no non-finite step is trained past or saved.

A NaN or inf loss or gradient norm poisons the weights for good, so the run ends with exit 76
at the next step boundary. With `rollback` the bad step's micro-batches are recorded as skipped
first (<state>/jobs/<job>/data_skips.json), so the supervisor's restart from the newest
checkpoint trains past them. No checkpoint ever holds a non-finite step's update: before every
save the values of the steps it would hold are waited for and checked (`state_is_finite`).

Values reach the host in batches through the backend, on the training thread (every rank reads
synchronously there) or on the backend's reader thread (XLA). What a reader thread finds is
acted on only after the next flush, which every host reaches at the same boundary; acting as
soon as one host's reader happened to finish would send the hosts different ways.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from engine import events, exit_codes
from engine.backends.base import Backend
from engine.checkpoint.checkpointer import Progress
from engine.data.loader import PackedLoader, merge_skips, write_skips

log = structlog.get_logger()


@dataclass(frozen=True)
class NonFinite:
    step: int                # the first logged step whose loss or grad norm is not finite
    loss: float
    grad_norm: float | None  # None for a partial step (no norm yet)


class NonFiniteGuard:
    def __init__(self, policy: str, backend: Backend, loader: PackedLoader, skips_path: Path,
                 emit: Callable[[events.Event], None], at: Progress):
        self.policy, self.backend, self.loader, self.skips_path, self.emit = policy, backend, loader, skips_path, emit
        self.found: NonFinite | None = None      # acted on at the next step boundary (or save)
        self._unflushed: NonFinite | None = None  # found on a reader thread, not yet flushed
        self._train_thread = threading.get_ident()
        # A restored partial step was checked before it was saved; another read would only wait.
        self._checked_at = (at.step, at.micro_step)

    def publishable(self, step: int, loss: float, grad_norm: float | None = None) -> bool:
        """Whether a read step's values may be reported: finite, and no earlier step's were not.

        Every step after a non-finite one trained on non-finite weights; only the first is recorded.
        """
        if self.found is not None or self._unflushed is not None:
            return False
        if math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm)):
            return True
        self._found(NonFinite(step, loss, grad_norm))
        return False

    def flush(self) -> None:
        """Wait for every value read in flight; what they found is then acted on."""
        self.backend.flush()
        self.found = self.found or self._unflushed

    def state_is_finite(self, progress: Progress) -> bool:
        """Read and check the values of every step a checkpoint of `progress` would hold, waiting for them.

        A checkpoint taken after a non-finite step would hold its update, and a rollback to it
        would only fail again; so no save starts before the steps it covers are known finite.
        The finished steps' values must have been read already (Reporter.report_pending or check_pending).
        """
        p = progress
        if p.micro_step and self._checked_at != (p.step, p.micro_step):
            # Inside accumulation: a poisoned micro-batch is in the partial gradient already.
            def check(rows: list) -> None:
                loss = rows[0][0] if isinstance(rows[0], list) else rows[0]  # [loss, *router stats] with experts
                if not math.isfinite(loss):
                    self._found(NonFinite(p.step + 1, loss, None))

            self.backend.read_values([p.loss_sum], check)
        self.flush()
        self._checked_at = (p.step, p.micro_step)
        return self.found is None

    def exit(self) -> int:
        """Exit 76 without a checkpoint; for a rollback, skip the bad step's batches from now on."""
        bad = self.found
        skip = None
        if self.policy == "rollback":
            # The restarted worker resumes from a checkpoint before the bad step (saves check first)
            # and reads past these micro-batches; persisted before exiting, or it would meet them again.
            skip = self.loader.skip_range(bad.step - 1)
            self.loader.skips = merge_skips(self.loader.skips, [skip])
            write_skips(self.skips_path, self.loader.skips)
        event = events.NonFinite(bad.step, bad.loss, bad.grad_norm, self.policy, skip)
        log.error(event.TYPE, **dataclasses.asdict(event))  # named like the event, as the checkpointer logs its events
        self.emit(event)
        return exit_codes.NONFINITE_LOSS

    def _found(self, bad: NonFinite) -> None:
        """A read found non-finite values (on the training thread or the backend's reader)."""
        if threading.get_ident() == self._train_thread:
            self.found = self.found or bad
        else:
            self._unflushed = self._unflushed or bad
