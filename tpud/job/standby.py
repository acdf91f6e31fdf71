"""Warm spare workers for a job, so a restart skips the seconds of imports.

One spare starts beside a cold worker: the two import side by side (an import uses one core).
When a restart is due, the spare it will take gets a successor at once, whose imports (at the
lowest CPU priority) then overlap the backoff and the restore, not only training.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from engine.spec.schema import JobSpec
from tpud.worker.process import WorkerProcess

log = structlog.get_logger()


class StandbyPool:
    def __init__(self, spawn: Callable[..., WorkerProcess], job: str):
        """spawn(spec, extra_env, standby=True) starts a worker process."""
        self.spawn, self.job = spawn, job
        self.spares: list[WorkerProcess] = []

    def take(self, spec: JobSpec, env: dict[str, str]) -> WorkerProcess | None:
        """A spare released to train `spec`, or None; spares that cannot serve are discarded."""
        while self.spares:
            spare = self.spares.pop(0)
            if spare.extra_env == env and spare.release(spec):
                return spare
            spare.discard()
        return None

    def keep(self, spec: JobSpec, env: dict[str, str] | None, count: int) -> None:
        """Keep `count` spares (none when the job does not want them)."""
        if env is None and self.spares:
            env = self.spares[0].extra_env
        while spec.restart.standby and env is not None and len(self.spares) < count:
            spare = self.spawn(spec, env, standby=True)
            self.spares.append(spare)
            log.info("standby worker started", job=self.job, pid=spare.pid)

    def discard(self) -> None:
        for spare in self.spares:
            spare.discard()
        self.spares.clear()
