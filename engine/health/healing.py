"""Healing a bad step in the worker, without a restart (docs/architecture.md, "Healing").

The step guard (engine.health.guard) found step S bad: its loss or gradient norm not finite, or
a spike. With K = health.spikes.skip_steps (1 for a non-finite step without spike settings):

1. Bound: past health.max_rollbacks within rollback_window_steps, the job fails (exit 76,
   the reason said), rather than loop.
2. Restore in place the newest state of step S - K or earlier: the memory tier's, else the
   disk's (engine.checkpoint.restore). With none, exit 76: the supervisor restarts the worker
   and its restart skips the bad step's batches (the guard's `exit`).
3. Replay (health.spikes.replay): train the steps up to S again on the same batches and read
   step S's values. Bad again, it was the data. Clean, it was the hardware: the replayed state
   is kept, nothing is skipped, and the event says so; with replicas, the ones whose own values
   of step S departed from their first run's are named and quarantined (engine.health.replicas).
4. The data's: restore the same state again, skip the micro-batches of steps S - K + 1 .. S
   (engine.health.ledger), set aside any newer state (it holds the skipped batches' updates),
   and train on. Each later checkpoint carries the skips.

A `rolled_back` event tells the supervisor: the spike, the state restored, the samples skipped,
the verdict, and the steps whose work was redone. Its time is the worker's `rollback` badput.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Protocol

import structlog

from engine import events
from engine.badput import Badput
from engine.checkpoint.checkpointer import Checkpointer
from engine.checkpoint.state import Progress
from engine.data.loader import PackedLoader
from engine.health.guard import BadStep, StepGuard
from engine.health.ledger import SkipLedger
from engine.health.replicas import ReplicaCheck
from engine.spec.schema import HealthConfig

log = structlog.get_logger()


class Rewindable(Protocol):
    """What the healer asks of the loop (engine.train.Trainer)."""

    progress: Progress

    def rewind(self, at_most: int) -> Progress | None:
        """Restore the newest state of step `at_most` or earlier in place; None if there is none."""

    def replay_step(self, local: bool = False) -> list[float]:
        """Train the current step to its end as the loop does, unreported; its values [loss, grad norm, ...]
        (the processes' mean; with `local`, this process's own loss)."""


def reproduced(bad: BadStep, values: list[float]) -> bool:
    """Whether a replayed step is bad again: not finite again, or a spike again (the same values
    up to the last digits a device's reductions may change)."""
    loss, grad_norm = values[0], values[1]
    if bad.spike is None:
        return not (math.isfinite(loss) and math.isfinite(grad_norm))
    return math.isclose(loss, bad.loss, rel_tol=1e-3) and math.isclose(grad_norm, bad.grad_norm, rel_tol=1e-2)


class Healer:
    def __init__(self, cfg: HealthConfig, guard: StepGuard, ledger: SkipLedger, loader: PackedLoader,
                 checkpointer: Checkpointer, badput: Badput, emit, replicas: ReplicaCheck):
        self.cfg, self.guard, self.ledger, self.loader, self.replicas = cfg, guard, ledger, loader, replicas
        self.checkpointer, self.badput, self.emit = checkpointer, badput, emit
        self.hardware: list[int] = []  # steps of the hardware verdicts, which the ledger does not record

    @property
    def skip_steps(self) -> int:
        return self.cfg.spikes.skip_steps if self.cfg.spikes is not None else 1

    def heal(self, loop: Rewindable) -> None:
        """Deal with the guard's bad step: returns once the loop can go on, else raises WorkerExit."""
        bad = self.guard.found
        if bad.spike is None and self.cfg.nonfinite == "stop":
            self.guard.exit()
        window = self.cfg.rollback_window_steps
        recent = self.ledger.recent(bad.step, window) + sum(1 for s in self.hardware if bad.step - s < window)
        if recent >= self.cfg.max_rollbacks:
            self.guard.exit(f"{recent} rollbacks within {self.cfg.rollback_window_steps} steps "
                                   f"(health.max_rollbacks); then {bad.describe()}")
        started, target = time.monotonic(), bad.step - self.skip_steps
        first_run = self.replicas.recorded(bad.step)  # the replay records over it
        with self.badput.timing("rollback"):
            restored = loop.rewind(target)
            if restored is None:
                log.warning("no state to roll back to in place; the supervisor restarts the worker", step=bad.step,
                            wanted_at_most=target)
                self.guard.exit()
            self._restored_replicas_agree(restored.step)
            restored_step, verdict = restored.step, "data"
            if self.cfg.spikes is None or self.cfg.spikes.replay:
                values = None
                while loop.progress.step < bad.step:
                    values = loop.replay_step()
                if not reproduced(bad, values):
                    verdict = "hardware"
                    self.hardware.append(bad.step)
                else:
                    loop.rewind(target)
            skip = None
            if verdict == "data":
                skip = self.ledger.skip(self.loader, bad.step, self.skip_steps, bad.kind, bad.loss)
                self.checkpointer.data_skips = self.loader.skips  # every later manifest carries them
                # States after the one restored hold the skipped batches' updates (skip_steps > 1,
                # or a partial step): no later restore may take them.
                self.checkpointer.forget_after(restored_step)
            self.guard.rewound(loop.progress)
        entry = self.ledger.entries[-1] if skip is not None else None
        event = events.RolledBack(
            step=bad.step, kind=bad.kind, reason=bad.describe(), restored_step=restored_step, verdict=verdict,
            skip=skip, samples=None if entry is None else list(entry.samples), redone_steps=bad.step - restored_step,
            seconds=round(time.monotonic() - started, 3))
        (log.warning if verdict == "data" else log.error)(event.TYPE.replace("_", " "), **dataclasses.asdict(event))
        self.emit(event)
        if verdict == "hardware" and (named := self.replicas.name_after_spike(bad.step, first_run)) is not None:
            self.replicas.settle(named, self.emit)  # quarantined (79), or the others restart (77)

    def _restored_replicas_agree(self, step: int) -> None:
        """The state a rollback restored, compared across the replicas (a collective: every rank
        heals alike). A bit flipped into one replica's weights can make the next loss non-finite
        before any periodic comparison saw it, and a state saved since holds the flip: replayed,
        the step fails again whatever data is skipped. The odd replica is quarantined (79) and the
        others restart (77) from a state they all hold; without a majority, from the last state all
        agreed on, the newer ones set aside."""
        mismatch = self.replicas.compare(step)
        if mismatch is None:
            return
        if not mismatch.odd and 0 < self.replicas.agreed < step:
            self.checkpointer.forget_after(self.replicas.agreed)
        self.replicas.settle(mismatch, self.emit)
