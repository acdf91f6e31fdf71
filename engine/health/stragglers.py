"""Stragglers (health.stragglers): a process that runs slower than the others for a while.

Data-parallel processes wait for each other at every step's collectives, so one slow host
holds the whole gang to its pace, and the step time alone cannot say which one it is. Each
process times its own forward passes (no collective waits inside them under DDP; the step's
other collectives are where the fast ones wait) and, after every step, the processes
all-gather that figure (one float each, over the training thread's gloo group). Each step
gives each process a ratio, its time over the median of the others' at that step; a process
whose median ratio over the last `steps` steps is `factor` (less a 3 % tolerance for timing
noise) for a tenth of `steps` steps in a row is flagged; under a quarter of the way from 1 to
the factor it is cleared. The median of the *others*: with two processes a median that includes
the slow one would halve its excess.

Every process reaches the same judgement from the same figures, so with `evict` (or tpud.yaml's
gang.evict_stragglers, passed as TPUD_GANG_EVICT_STRAGGLERS) they act on it
together: all save, the straggler exits 79 (QUARANTINED: its supervisor fails the job there)
and the others 77 (GANG_RESTART: the gang goes on without it where gang.min_hosts allows).

On accelerators the host only queues the forward's kernels, so its time there measures the
host's side; the flag is meant for CPU-bound and host-bound slowness until device timers are
wired in.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics

import structlog

from engine import events, exit_codes
from engine.spec.schema import StragglerConfig

log = structlog.get_logger()


# Timings of equal work scatter by a few percent: a process slowed by exactly `factor` must not
# pass or fail on that noise, so the flag is raised a little under the factor.
TOLERANCE = 0.97


class StragglerJudge:
    """The rule alone, torch-free: each step, each rank's forward time over the median of the other
    ranks' at that step (a ratio of the same moment: the machine's speed drifting moves both
    sides); a rank whose median ratio over the last `steps` steps is TOLERANCE x factor or more,
    for a few judgments in a row (`persist`), is flagged: more than half of the window slow, and
    not a window tipped for a moment. Cleared under a quarter of the way from 1 to the factor, so
    that a slow rank's noisy window does not flap."""

    def __init__(self, factor: float, steps: int):
        self.factor, self.steps = factor, steps
        self.persist = max(1, steps // 10)
        self.windows: dict[int, collections.deque] = {}
        self.over: dict[int, int] = {}  # judgments in a row at or over the bar, by rank
        self.flagged: set[int] = set()

    def observe(self, times: list[float]) -> list[tuple[int, float, bool]]:
        """One step's times by rank -> the (rank, ratio, flagged) whose flag changed at this step."""
        for rank, mine in enumerate(times):
            others = statistics.median(times[:rank] + times[rank + 1:])
            ratio = mine / others if others > 0 else 1.0
            self.windows.setdefault(rank, collections.deque(maxlen=self.steps)).append(ratio)
        if len(self.windows[0]) < self.steps:
            return []
        changes = []
        for rank in range(len(times)):
            ratio = statistics.median(self.windows[rank])
            self.over[rank] = self.over.get(rank, 0) + 1 if ratio >= TOLERANCE * self.factor else 0
            if rank not in self.flagged and self.over[rank] >= self.persist:
                self.flagged.add(rank)
                changes.append((rank, ratio, True))
            elif rank in self.flagged and ratio < 1 + (self.factor - 1) / 4:
                self.flagged.discard(rank)
                changes.append((rank, ratio, False))
        return changes

    def reset(self) -> None:
        """A rollback or restore: the steps about to be redone are judged afresh."""
        self.windows.clear()
        self.over.clear()


class StragglerWatch:
    """The worker's side: times this process's forwards, gathers every process's after each step,
    reports the judge's changes and evicts when the job asks."""

    def __init__(self, cfg: StragglerConfig | None, backend, emit, gang_evicts: bool = False):
        """gang_evicts: tpud.yaml's gang.evict_stragglers, for every job on its hosts (engine.runtime)."""
        self.cfg, self.backend, self.emit = cfg, backend, emit
        multi = backend.data.world > 1 and backend.agreement_group is not None
        self.judge = StragglerJudge(cfg.factor, cfg.steps) if cfg is not None and multi else None
        self.seconds = 0.0  # this step's forward time so far
        # The job's setting, or its gang's (tpud.yaml's gang.evict_stragglers, for every job there).
        self.evict = cfg is not None and (cfg.evict or gang_evicts)

    @property
    def enabled(self) -> bool:
        return self.judge is not None

    def forward_took(self, seconds: float) -> None:
        self.seconds += seconds

    def reset(self) -> None:
        self.seconds = 0.0
        if self.judge is not None:
            self.judge.reset()

    def step_done(self, step: int) -> list[events.Straggler]:
        """After every step, on every process alike (a collective): the flags raised or cleared."""
        if self.judge is None:
            return []
        import torch
        import torch.distributed as dist

        group = self.backend.agreement_group
        mine = torch.tensor([self.seconds], dtype=torch.float64)
        self.seconds = 0.0
        times = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(times, mine, group=group)
        found = []
        for rank, ratio, flagged in self.judge.observe([float(t) for t in times]):
            evicted = flagged and self.evict
            verb = "is a straggler" if flagged else "is no longer a straggler"
            reason = (f"rank {rank} {verb}: its forward took a median {ratio:.2f}x the others' over the last "
                      f"{self.cfg.steps} steps, at step {step} (factor {self.cfg.factor:g})" + ("; evicted" if evicted else ""))
            event = events.Straggler(step=step, straggler=rank, rank=self.backend.data.rank, ratio=round(ratio, 3),
                                     flagged=flagged, evicted=evicted, reason=reason)
            # An eviction's line is an error: the supervisor names the failed job by its last one.
            (log.error if evicted else log.warning if flagged else log.info)(reason, **dataclasses.asdict(event))
            self.emit(event)
            found.append(event)
        return found

    def eviction(self, found: list[events.Straggler]) -> int | None:
        """The exit code when a straggler is evicted (79 for it, 77 for the others), else None."""
        evicted = [event.straggler for event in found if event.evicted]
        if not evicted:
            return None
        # A host's processes (consecutive ranks of a gang) are evicted together.
        host_of = self.backend.host_of
        return exit_codes.QUARANTINED if host_of(self.backend.data.rank) in map(host_of, evicted) else exit_codes.GANG_RESTART
