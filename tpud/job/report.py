"""What a job's workers last reported of their training: the latest step, the validation loss,
the step a worker restored, a bad step it could not heal, the rollbacks it healed in place, and
the metrics that show them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from engine import events, fitting
from engine.health.ledger import summary_of


class WorkerReport:
    def __init__(self, job: str, metrics, clock: Callable[[], float], ledger: Path | None = None,
                 fitted: Path | None = None):
        """ledger: the job's skip ledger (engine.health.ledger), which status summarises; fitted: its
        micro-batch record (engine.fitting)."""
        self.job, self.metrics, self.clock, self.ledger, self.fitted = job, metrics, clock, ledger, fitted
        self.progress: events.Step | None = None  # the latest step event, for status
        self.evaluated: events.Eval | None = None  # the latest validation loss, for status
        self.restored_step: int | None = None  # status's step before the first step event
        self.nonfinite: events.NonFinite | None = None  # the current worker's, for its exit 76
        self.rollbacks: list[events.RolledBack] = []  # healed in place since this daemon started
        self.mismatch: events.ReplicaMismatch | None = None  # the replicas' last disagreement
        self.stragglers: dict[int, events.Straggler] = {}  # by rank: the flagged, and the last cleared

    def new_worker(self) -> None:
        self.nonfinite = None

    def on_hello(self, event: events.Hello | events.Heartbeat) -> None:
        self.metrics.heartbeat(self.job, self.clock())

    on_heartbeat = on_hello  # both say only that the worker is alive

    def on_step(self, event: events.Step) -> None:
        self.progress = event
        self.metrics.heartbeat(self.job, self.clock())
        self.metrics.job_progress(self.job, step=event.step, loss=event.loss, tokens_per_second=event.tokens_per_s,
                                  mfu=event.mfu)
        if (routers := experts(event)) is not None:
            self.metrics.experts(self.job, **routers)
        self.metrics.device(self.job, in_use=event.device_memory_in_use_bytes, peak=event.device_memory_bytes,
                            compilations=event.compilations, compile_seconds=event.compile_seconds)

    def on_eval(self, event: events.Eval) -> None:
        self.evaluated = event
        self.metrics.eval_loss(self.job, event.loss)

    def on_checkpoint_restored(self, event: events.CheckpointRestored) -> None:
        self.restored_step = event.step

    def on_nonfinite(self, event: events.NonFinite) -> None:
        self.nonfinite = event

    def on_rolled_back(self, event: events.RolledBack) -> None:
        self.rollbacks.append(event)
        self.metrics.rolled_back(self.job, kind=event.kind, verdict=event.verdict,
                                 samples=event.samples[1] if event.samples else 0, redone_steps=event.redone_steps)

    def on_replica_mismatch(self, event: events.ReplicaMismatch) -> None:
        self.mismatch = event
        self.metrics.replica_mismatch(self.job, odd=",".join(map(str, event.odd)) or "none",
                                      quarantined=event.rank in event.odd)

    def on_straggler(self, event: events.Straggler) -> None:
        self.stragglers[event.straggler] = event
        self.metrics.straggler(self.job, host=event.straggler, ratio=event.ratio, flagged=event.flagged)

    def snapshot(self, max_steps: int, micro_batch_size: int | str | None = None) -> dict:
        progress, evaluated = self.progress, self.evaluated
        return {
            "micro_batch": self.micro_batch(micro_batch_size),
            "step": self.restored_step if progress is None else progress.step, "max_steps": max_steps,
            "loss": None if progress is None else progress.loss,
            "tokens_per_second": None if progress is None else progress.tokens_per_s,
            "mfu": None if progress is None else progress.mfu,
            "step_time_s": None if progress is None else progress.step_time_s,
            "eval_loss": None if evaluated is None else evaluated.loss,
            "eval_step": None if evaluated is None else evaluated.step,
            "experts": None if progress is None else experts(progress),
            "device": None if progress is None else device(progress),
            "healing": self.healing(),
            "replicas": None if self.mismatch is None else {
                "step": self.mismatch.step, "agreed_step": self.mismatch.agreed_step, "odd": self.mismatch.odd,
                "quarantined": self.mismatch.rank in self.mismatch.odd, "found_by": self.mismatch.found_by,
                "healed": self.mismatch.healed, "reason": self.mismatch.reason},
            "stragglers": [{"host": e.straggler, "ratio": e.ratio, "step": e.step, "flagged": e.flagged,
                            "evicted": e.evicted, "reason": e.reason} for _, e in sorted(self.stragglers.items())],
        }

    def micro_batch(self, configured: int | str | None) -> dict | None:
        """The micro-batch the job's workers run when it is not the job file's: the size that fitted in
        memory (engine.fitting), what it was made smaller from, and why; None when none was fitted."""
        record = None if self.fitted is None else fitting.read(self.fitted)
        if record is None or record.configured != configured:
            return None
        return {"size": record.size, "configured": configured, "reason": record.reason, "step": record.step}

    def healing(self) -> dict | None:
        """The rollbacks healed in place since this daemon started, and the job's skip ledger."""
        skipped = None if self.ledger is None else summary_of(self.ledger)
        if not self.rollbacks and not skipped:
            return None
        last = self.rollbacks[-1] if self.rollbacks else None
        return {"rollbacks": len(self.rollbacks), "hardware": sum(e.verdict == "hardware" for e in self.rollbacks),
                "redone_steps": sum(e.redone_steps for e in self.rollbacks), "skipped": skipped,
                "last": None if last is None else {"step": last.step, "kind": last.kind, "verdict": last.verdict,
                                                   "restored_step": last.restored_step, "reason": last.reason}}

    def nonfinite_exit(self) -> tuple[str, bool]:
        """Exit 76: what went wrong, and whether the worker asked for a rollback."""
        event = self.nonfinite
        if event is None:
            return "non-finite loss (the worker's report was lost)", False
        return event.reason or f"non-finite loss ({event.loss}) at step {event.step}", event.policy == "rollback"


def experts(step: events.Step) -> dict | None:
    """A mixture of experts' router figures of a step (events.Step's aux_loss ... dropped_fraction); None if dense."""
    if step.aux_loss is None:
        return None
    return {"aux_loss": step.aux_loss, "z_loss": step.z_loss, "load_max": step.expert_load_max,
            "load_cv": step.expert_load_cv, "dropped_fraction": step.dropped_fraction}


def device(step: events.Step) -> dict | None:
    """What a step event says of the device (events.Step's device fields); None where it says nothing."""
    values = {"memory_in_use_bytes": step.device_memory_in_use_bytes, "memory_peak_bytes": step.device_memory_bytes,
              "compilations": step.compilations, "compile_seconds": step.compile_seconds}
    return values if any(v is not None for v in values.values()) else None
