"""The step guard: no bad step is trained past or saved.

A bad step is one whose loss or gradient norm is not finite (NaN or inf poisons the weights for
good), or a loss spike (engine.health.spikes, with `health.spikes`). The guard finds it in the
values the loop reads in batches; the loop then heals in place (engine.health.healing: a
rollback to a state from before it, its batches skipped) or, where it cannot, exits 76 at the
next step boundary (`exit`). No checkpoint ever holds a bad step's update: before every save the
values of the steps it would hold are waited for and checked (`state_is_clean`).

Values reach the host in batches through the backend, on the training thread (every rank reads
synchronously there) or on the backend's reader thread (XLA). What a reader thread finds is
acted on only after the next flush, which every host reaches at the same boundary; acting as
soon as one host's reader happened to finish would send the hosts different ways. The values are
the global batch's (the backend averages them over ranks), so every rank finds the same steps.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import structlog

from engine import events, exit_codes
from engine.errors import WorkerExit
from engine.backends.base import Backend
from engine.checkpoint.checkpointer import Progress
from engine.data.loader import PackedLoader
from engine.health.ledger import SkipLedger
from engine.health.spikes import Spike, SpikeDetector
from engine.spec.schema import HealthConfig

log = structlog.get_logger()


@dataclass(frozen=True)
class BadStep:
    step: int                # the first logged step whose values are bad
    loss: float
    grad_norm: float | None  # None for a partial step (no norm yet)
    spike: Spike | None = None  # None: not finite

    @property
    def kind(self) -> str:
        return "nonfinite" if self.spike is None else "spike"

    def describe(self) -> str:
        if self.spike is not None:
            return f"loss spike: {self.spike.describe()}"
        return f"non-finite loss ({self.loss}) or gradient norm ({self.grad_norm}) at step {self.step}"


class StepGuard:
    def __init__(self, cfg: HealthConfig, backend: Backend, loader: PackedLoader, ledger: SkipLedger,
                 emit: Callable[[events.Event], None], at: Progress):
        self.cfg, self.backend, self.loader, self.ledger, self.emit = cfg, backend, loader, ledger, emit
        self.spikes = SpikeDetector(cfg.spikes) if cfg.spikes is not None else None
        self.found: BadStep | None = None      # acted on at the next step boundary (or save)
        self._unflushed: BadStep | None = None  # found on a reader thread, not yet flushed
        self._train_thread = threading.get_ident()
        # A restored partial step was checked before it was saved; another read would only wait.
        self._checked_at = (at.step, at.micro_step)

    def publishable(self, step: int, loss: float, grad_norm: float | None = None) -> bool:
        """Whether a finished step's values may be reported: clean, and no earlier step's were bad.

        Every step after a bad one trained on its update; only the first is recorded.
        """
        if self.found is not None or self._unflushed is not None:
            return False
        if not (math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm))):
            self._found(BadStep(step, loss, grad_norm))
            return False
        spike = None if self.spikes is None else self.spikes.observe(step, loss, grad_norm)
        if spike is not None:
            self._found(BadStep(step, loss, grad_norm, spike))
            return False
        return True

    def flush(self) -> None:
        """Wait for every value read in flight; what they found is then acted on."""
        self.backend.flush()
        self.found = self.found or self._unflushed

    def state_is_clean(self, progress: Progress) -> bool:
        """Read and check the values of every step a checkpoint of `progress` would hold, waiting for them.

        A checkpoint taken after a bad step would hold its update, and a rollback to it would
        only meet it again; so no save starts before the steps it covers are known clean.
        The finished steps' values must have been read already (Reporter.report_pending or check_pending).
        """
        p = progress
        if p.micro_step and self._checked_at != (p.step, p.micro_step):
            # Inside accumulation: a poisoned micro-batch is in the partial gradient already.
            def check(rows: list) -> None:
                loss = rows[0][0] if isinstance(rows[0], list) else rows[0]  # [loss, *router stats] with experts
                if not math.isfinite(loss):
                    self._found(BadStep(p.step + 1, loss, None))

            self.backend.read_values([p.loss_sum], check)
        self.flush()
        self._checked_at = (p.step, p.micro_step)
        return self.found is None

    def rewound(self, progress: Progress) -> None:
        """The loop went back to `progress` (engine.health.healing): what was found is dealt with."""
        self.found = self._unflushed = None
        self._checked_at = (progress.step, progress.micro_step)
        if self.spikes is not None:
            self.spikes.rewound(progress.step)

    def exit(self, why: str | None = None) -> NoReturn:
        """Exit 76 without a checkpoint; with health.nonfinite rollback and no `why` (a reason to
        stop instead), the supervisor's restart then skips the bad step's batches."""
        bad = self.found
        skip = None
        policy = "stop" if why is not None else self.cfg.nonfinite
        if policy == "rollback":
            # The restarted worker resumes from a checkpoint before the bad step (saves check first)
            # and reads past these micro-batches; recorded before exiting, or it would meet them again.
            skip = self.ledger.skip(self.loader, bad.step, 1, bad.kind, bad.loss)
        event = events.NonFinite(bad.step, bad.loss, bad.grad_norm, policy, skip, why or bad.describe())
        log.error(event.TYPE, **dataclasses.asdict(event))  # named like the event, as the checkpointer logs its events
        self.emit(event)
        raise WorkerExit(exit_codes.NONFINITE_LOSS)

    def _found(self, bad: BadStep) -> None:
        """A read found bad values (on the training thread or the backend's reader)."""
        if threading.get_ident() == self._train_thread:
            self.found = self.found or bad
        else:
            self._unflushed = self._unflushed or bad

