"""What a job knows of its checkpoints: the newest committed one on any tier, the callers of
`tpud checkpoint-now` waiting for the next local commit, the tiers' failure streaks, how
long a local save takes (which sets how much of a preemption deadline the step may use),
the auto tiers' intervals (the worker's, and the GCS uploader's), and the checkpoint metrics."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from engine import events
from engine.checkpoint import manifest as mf
from engine.checkpoint.policy import Interval
from tpud.job.save_failures import SaveFailures


@dataclass
class Checkpoint:
    step: int
    micro_step: int
    tier: str
    path: str
    at: float  # wall time


@dataclass
class Waiter:
    """A `tpud checkpoint-now` caller waiting for the next local commit."""

    future: Future
    after_step: int = 0  # only a checkpoint of this step or later answers the request
    since: float = field(default_factory=time.monotonic)


class JobCheckpoints:
    def __init__(self, job: str, metrics, post: Callable[[Callable[[], None]], None]):
        """post(fn): run fn on the daemon's loop."""
        self.job, self.metrics, self.post = job, metrics, post
        self.last: Checkpoint | None = None  # the newest on disk or GCS
        self.memory: Checkpoint | None = None  # the newest in the memory tier
        self.tiers: dict[str, Checkpoint] = {}  # the newest on each tier (local, memory, gcs)
        self.waiters: list[Waiter] = []
        self.failures = SaveFailures()
        self.save_seconds = 0.0  # how long the last local save took
        self.intervals: dict[str, dict] = {}  # tier -> its auto interval (engine.checkpoint.policy.Interval.as_dict)

    def found_local(self, job_dir: Path) -> Checkpoint | None:
        """The newest committed step a former worker (or daemon) left on the local tier, from its
        manifest: status and metrics show it from the start, not from the first new commit."""
        try:
            committed = mf.committed_steps(job_dir)
        except OSError:  # an unreadable directory: the worker's restore says more
            return None
        if not committed:
            return None
        step, path, manifest = committed[-1]
        self.last = self.tiers["local"] = Checkpoint(step, manifest.micro_step, "local", str(path),
                                                     manifest.created_unix)
        self.metrics.checkpoint_found(self.job, tier="local", step=step, at=manifest.created_unix)
        return self.last

    def holds_step(self, step: int) -> bool:
        """Whether the newest committed local checkpoint (a gang's: globally) is at least `step`: a
        worker that fails after committing max_steps (an abort in its teardown) left nothing to train,
        and a restart would only wait for a gang whose other hosts are done."""
        local = self.tiers.get("local")
        return local is not None and local.micro_step == 0 and local.step >= step

    def holds_final(self, job_dir: Path, max_steps: int) -> bool:
        """Whether the newest committed local step (looked at again: a start may have brought GCS's
        newest here) is the job's final save at max_steps: a gang's job its other hosts finished.
        Not a newer step, nor an interval save at that step: after an edit of max_steps every host
        still starts its worker and the gang saves its final step together."""
        found = self.found_local(job_dir)
        if found is None or (found.step, found.micro_step) != (max_steps, 0):
            return False
        manifest = mf.read_manifest(Path(found.path))
        # Files missing or cut short: the worker's restore sets it aside and trains from an older
        # one. Sizes only: the checksums of a large state are no work for the daemon's loop.
        return manifest is not None and manifest.reason == "final" and not mf.problems(
            Path(found.path), manifest, checksums=False)

    def wait_for_next(self, after_step: int) -> Future:
        """A future resolved with the next local commit of `after_step` or later."""
        waiter = Waiter(Future(), after_step=after_step)
        self.waiters.append(waiter)
        return waiter.future

    @staticmethod
    def refused(error: str) -> Future:
        """The answer to a request no checkpoint can answer."""
        future: Future = Future()
        future.set_exception(RuntimeError(error))
        return future

    def fail_waiters(self, error: str) -> None:
        for waiter in self.waiters:
            waiter.future.set_exception(RuntimeError(error))
        self.waiters.clear()

    # --- the worker's events (tpud/job/routing.py) ---

    def on_step(self, event: events.Step) -> None:
        if event.checkpoint_interval_s is not None:  # as the worker's schedule applies it
            self.metrics.checkpoint_interval(self.job, event.checkpoint_interval_s)
        if event.checkpoint_intervals:
            self.metrics.checkpoint_policy(self.job, event.checkpoint_intervals)
        gcs = {"gcs": self.intervals["gcs"]} if "gcs" in self.intervals else {}
        self.intervals = {**(event.checkpoint_intervals or {}), **gcs}

    def on_checkpoint_committed(self, event: events.CheckpointCommitted) -> None:
        self.metrics.checkpoint(self.job, tier=event.tier, reason=event.reason, seconds=event.seconds,
                                bytes=event.bytes, step=event.step)
        if event.tier == "memory":
            self.in_memory(event)
        else:
            self.committed(event)

    def on_checkpoint_failed(self, event: events.CheckpointFailed) -> None:
        self.metrics.checkpoint_failure(self.job, event.tier)
        memory = event.tier == "memory"
        self.failures.failed("memory" if memory else "local", event.error, event.step)
        if not memory:  # only a local commit answers checkpoint-now
            self.fail_waiters(event.error)

    def committed(self, event: events.CheckpointCommitted) -> None:
        """A local commit: the newest checkpoint, and the answer to the waiters it satisfies."""
        if event.seconds > 0:
            self.save_seconds = event.seconds
        self.last = self.tiers["local"] = Checkpoint(event.step, event.micro_step, "local", event.path, time.time())
        self.failures.committed("local")
        result = {"job": self.job, "ok": True, "step": event.step, "micro_step": event.micro_step,
                  "tier": "local", "path": event.path}
        # An older save still being written when the request came does not answer it.
        answered = [w for w in self.waiters if event.step >= w.after_step]
        for waiter in answered:
            waiter.future.set_result({**result, "seconds": round(time.monotonic() - waiter.since, 3)})
        self.waiters = [w for w in self.waiters if w not in answered]

    def in_memory(self, event: events.CheckpointCommitted) -> None:
        """A memory commit: it survives the worker, not the host, so it answers no checkpoint-now."""
        self.memory = self.tiers["memory"] = Checkpoint(event.step, event.micro_step, "memory", event.path,
                                                        time.time())
        self.failures.committed("memory")

    def memory_discarded(self) -> None:
        self.memory = None
        self.tiers.pop("memory", None)

    def upload_result(self, key: tuple[int, int], transfer, error: str | None, policy: Interval | None) -> None:
        """From the uploader's thread, after each attempt (tpud/gcs/tiers.py)."""
        if policy is not None:
            self.metrics.checkpoint_policy(self.job, {"gcs": policy.as_dict()})
            self.post(lambda: self.intervals.update(gcs=policy.as_dict()))
        if transfer is None:
            self.metrics.checkpoint_failure(self.job, "gcs")
            self.post(lambda: self.failures.failed("gcs", error, key[0]))
            return
        self.metrics.checkpoint(self.job, tier="gcs", reason="upload", seconds=transfer.seconds,
                                bytes=transfer.bytes, step=key[0])
        self.post(lambda: self.uploaded(*key))

    def uploaded(self, step: int, micro_step: int) -> None:
        self.failures.committed("gcs")
        self.tiers["gcs"] = Checkpoint(step, micro_step, "gcs", "", time.time())
        if self.last is None or (step, micro_step) >= (self.last.step, self.last.micro_step):
            self.last = Checkpoint(step, micro_step, "gcs", "", time.time())

    def step_budget(self, deadline_s: float) -> float:
        """Of `deadline_s`, the time the worker may spend finishing its step: the rest writes the checkpoint."""
        return max(0.0, deadline_s - 1.5 * self.save_seconds - 1.0)

    def snapshot(self) -> dict:
        def brief(c: Checkpoint | None) -> dict | None:
            return None if c is None else {"step": c.step, "tier": c.tier, "age_seconds": round(time.time() - c.at, 1)}

        return {"last_checkpoint": brief(self.last), "memory_checkpoint": brief(self.memory),
                "checkpoints": {tier: brief(c) for tier, c in self.tiers.items()},
                "checkpoint_intervals": self.intervals or None,
                "warnings": self.failures.warnings(), "checkpoint_failures": self.failures.snapshot()}
