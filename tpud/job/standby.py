"""Warm spare workers for a job, so a restart skips the seconds of imports.

One spare starts beside a cold worker: the two import side by side (an import uses one core).
When a restart is due, the spare it will take gets a successor at once, whose imports (at the
lowest CPU priority) then overlap the backoff and the restore, not only training.

A spare that dies while it waits (the OOM killer, a stray `kill`) is seen at once, through its
sentinel in the loop, and replaced (tpud/respawn.py): else the next restart would find it gone
and start cold.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

from engine.spec.schema import JobSpec
from tpud.respawn import Respawn
from tpud.worker.process import WorkerProcess

log = structlog.get_logger()


class StandbyPool:
    def __init__(self, spawn: Callable[..., WorkerProcess], job: str, loop,
                 clock: Callable[[], float] = time.monotonic):
        """spawn(spec, extra_env, standby=True) starts a worker process; `loop` watches the spares' sentinels."""
        self.spawn, self.job, self.loop = spawn, job, loop
        self.spares: list[WorkerProcess] = []
        self._wanted: tuple[JobSpec, dict[str, str], int] | None = None  # keep()'s last ask, for replacements
        self._respawn = Respawn(clock)

    def take(self, spec: JobSpec, env: dict[str, str]) -> WorkerProcess | None:
        """A spare released to train `spec`, or None; spares that cannot serve are discarded."""
        while self.spares:
            spare = self._forget(self.spares[0])
            if spare.extra_env == env and spare.release(spec):
                return spare
            spare.discard()
        return None

    def keep(self, spec: JobSpec, env: dict[str, str] | None, count: int) -> None:
        """Keep `count` spares (none when the job does not want them), with the env of the last ones
        when `env` is None."""
        if env is None and self._wanted is not None:
            env = self._wanted[1]
        if not spec.restart.standby or env is None:
            return
        self._wanted = (spec, env, count)
        while len(self.spares) < count:
            spare = self.spawn(spec, env, standby=True)
            self._respawn.started()
            self.spares.append(spare)
            self.loop.watch(spare.sentinel, lambda spare=spare: self._died(spare))
            log.info("standby worker started", job=self.job, pid=spare.pid)

    def discard(self) -> None:
        """No spares now, and none started again until keep() is called."""
        while self.spares:
            self._forget(self.spares[0]).discard()
        self._wanted = None

    def tick(self) -> None:
        """Replace a spare that died, once its backoff is over."""
        if self._missing and self._respawn.ready():
            self.keep(*self._wanted)

    @property
    def due(self) -> float | None:
        """When tick() has a spare to start (the clock's time); None when none is missing."""
        return self._respawn.due if self._missing else None

    @property
    def _missing(self) -> bool:
        return self._wanted is not None and len(self.spares) < self._wanted[2]

    def _died(self, spare: WorkerProcess) -> None:
        status = self._forget(spare).discard()
        in_s = self._respawn.died()
        log.warning("standby worker exited; starting another", job=self.job, pid=spare.pid, status=status,
                    in_s=round(in_s, 1))
        self.tick()

    def _forget(self, spare: WorkerProcess) -> WorkerProcess:
        self.spares.remove(spare)
        self.loop.unwatch(spare.sentinel)
        return spare
