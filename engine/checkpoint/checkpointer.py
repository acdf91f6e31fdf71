"""Save and restore the whole training state with torch.distributed.checkpoint.

State (engine.checkpoint.state): model and optimizer (DCP's FQN-keyed state dicts, sharded
under SPMD), the loop's progress (step, micro-step, tokens seen), the loss and gradients
accumulated so far when the save falls inside gradient accumulation, every RNG state, and the
data loader's geometry (its position is a pure function of the step). Resuming from it
continues exactly where the saved run was.

A save stages the state to host memory on the training thread (the only part the loop
waits for when async) and writes it from a background thread (engine.checkpoint.writer): DCP
files into a temporary directory, then manifest.json with sizes and CRC32C, then an atomic
rename to step_N. At most one save is in flight. Local retention never deletes the newest
step or one the supervisor has pinned while uploading it. An interval save is due every
interval_steps steps, and once interval_seconds have passed since the last save (`due`,
engine.checkpoint.schedule).

A save that fails (a full disk, an I/O error, a read-only or vanished directory, any DCP
error) is not fatal: its temporary directory is removed at once (it would hold the very
space the next save needs), a `checkpoint_failed` event says why, and training goes on to
try again at the next interval; `failures` counts them in a row. Before writing, when
the file system's free space is short of the last checkpoint's size, older committed
steps are deleted to make room (never the newest, never a pinned one;
engine.checkpoint.retention).

The manifest also carries what must follow the checkpoint to another host but is not
tensor state: the loader's skipped batch ranges (`data_skips`, set by the trainer) and the
supervisor's wandb run id (TPUD_WANDB_RUN_ID in the worker's environment); and the job spec's
fingerprint (engine.spec.fingerprint), by which a job on several hosts refuses to resume a
checkpoint made with another spec.

With a memory tier (`memory_dir`, engine.checkpoint.memory and .promotion) a state is copied
into host shared memory every checkpoint.memory.interval_steps steps; a disk save of a step
the memory tier holds (or can take) writes from there, so the loop waits for one copy only. A
request that arrives between boundaries (`promote`, from the hooks' listening thread) is
answered at once by writing the newest memory state to disk. Restore takes the newest valid state of both tiers
(engine.checkpoint.restore).

A job on several hosts (`hosts`) saves each host's part into its own local tier and commits
it globally (engine.checkpoint.hosts): the commit event follows the global marker, and restore
takes the step the hosts agree on.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import structlog
import torch
import torch.distributed as dist
from torch import nn

from engine import events
from engine.backends.base import Backend
from engine.checkpoint import hosts as gang
from engine.checkpoint import manifest as mf
from engine.checkpoint import memory as mem
from engine.checkpoint import retention
from engine.checkpoint.promotion import Promotion, memory_tier
from engine.checkpoint.restore import Restorer
from engine.checkpoint.schedule import SaveSchedule
from engine.checkpoint.state import Progress, TrainingState
from engine.checkpoint.writer import DiskWriter
from engine.spec import fingerprint as spec_fingerprint
from engine.spec.schema import CheckpointConfig

__all__ = ["Checkpointer", "Emit", "Progress"]

log = structlog.get_logger()
Emit = Callable[[events.Event], None]


@functools.cache
def _version() -> str:
    try:
        return metadata.version("tpud")
    except metadata.PackageNotFoundError:
        return "unknown"


class Checkpointer:
    def __init__(self, cfg: CheckpointConfig, job: str, job_dir: Path, fingerprint: dict, backend: Backend,
                 model: nn.Module, optimizer: torch.optim.Optimizer, loader_state: dict, emit: Emit,
                 hosts: gang.Hosts | None = None, memory_dir: Path | None = None,
                 disruptions_per_hour: float | None = None, wandb_run_id: str | None = None):
        self.cfg, self.job, self.fingerprint, self.hosts = cfg, job, fingerprint, hosts
        self.spec_hash = spec_fingerprint.digest(fingerprint)
        self.job_dir = Path(job_dir)  # this job's local tier (engine.layout.StateLayout.checkpoints)
        self.backend, self.model, self.optimizer = backend, model, optimizer
        self.loader_state, self._emit = loader_state, emit
        # Several hosts: each writes its own part into its own directory, alone or with its own
        # processes, and commits it with one process of each other host (engine.checkpoint.hosts).
        self.group = backend.host_group if hosts else backend.checkpoint_group
        self.hosts_group = (backend.checkpoint_group if backend.replica_group is None else backend.replica_group
                            ) if hosts else None
        self.rank = dist.get_rank(self.group) if self.group is not None else 0
        self.world = dist.get_world_size(self.group) if self.group is not None else 1
        self.data_skips: tuple[tuple[int, int], ...] = ()  # written into every manifest from now on
        self.wandb_run_id = wandb_run_id
        self.restored: mf.Manifest | None = None  # the manifest of the checkpoint restore() loaded
        self.restored_loader: dict | None = None  # and the loader state it was saved with
        self.last_saved_step: int | None = None
        self.schedule = SaveSchedule(cfg, backend, disruptions_per_hour)
        self.writer = DiskWriter(self.job_dir, cfg.keep, backend, self.group, self.rank, self.world, hosts,
                                 self.hosts_group, self._describe, self.emit)
        self.job_dir.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            retention.remove_unfinished(self.job_dir)
        self.memory = memory_tier(cfg, backend, self.world, self.rank, memory_dir, job, self._describe, self.emit)
        self.promotion = None if self.memory is None else Promotion(self.memory, self.writer, self.last_committed_step)
        self.state = TrainingState(backend, model, optimizer, loader_state, every_step=self.memory is not None)
        self.restorer = Restorer(self.job_dir, self.state, backend, self.group, self.rank, hosts, self.hosts_group,
                                 self.memory, self.writer.pool)

    @property
    def failures(self) -> int:
        """Saves that failed since the last commit."""
        return self.writer.failures

    def _describe(self, directory: Path, step: int, micro_step: int, reason: str,
                  files: tuple[mf.FileEntry, ...] | None = None,
                  data_skips: tuple[tuple[int, int], ...] | None = None) -> mf.Manifest:
        """The manifest of `directory`'s files (checksummed here unless `files` says)."""
        make = mf.Manifest.describe if files is None else (lambda _, **fields: mf.Manifest(files=files, **fields))
        return make(
            directory, job=self.job, step=step, micro_step=micro_step, world_size=self.world,
            spec_hash=self.spec_hash, fingerprint=self.fingerprint, version=_version(), reason=reason,
            wandb_run_id=self.wandb_run_id,
            data_skips=self.data_skips if data_skips is None else data_skips, host=self.hosts.index if self.hosts else 0,
            hosts=self.hosts.count if self.hosts else 1, members=self.hosts.members if self.hosts else ())

    def emit(self, event: events.Event) -> None:
        """To the supervisor through the hooks, and to the log for the operator."""
        fields = dataclasses.asdict(event)
        if isinstance(event, events.CheckpointFailed):
            log.warning(event.TYPE.replace("_", " "), **fields)
        else:  # the memory tier commits every step or few: not a line each in the operator's log
            (log.debug if getattr(event, "tier", "") == "memory" else log.info)(event.TYPE.replace("_", " "), **fields)
        self._emit(event)

    # --- saving ---

    def due(self, step: int) -> bool:
        """Whether an interval checkpoint is due now, `step` steps done; every rank gets the same answer."""
        return self.schedule.due(step)

    def step_done(self) -> None:
        """A step ended: its time feeds the auto intervals (engine.checkpoint.policy)."""
        self.schedule.step_done()

    def intervals(self) -> dict[str, dict]:
        """Each auto tier's interval in force, save cost, assumed disruption rate and expected loss."""
        return {tier: interval.as_dict() for tier, interval in self.schedule.intervals().items()}

    def memory_due(self, step: int) -> bool:
        """Whether the memory tier saves at this step (engine.checkpoint.schedule)."""
        if self.memory is None:
            return False
        due = self.schedule.memory_due(step)
        # Several processes sharing one checkpoint save their shards together (each judges the auto
        # interval by its own clock), so that they hold the same steps to restore.
        return self.backend.any_rank(due) if self.world > 1 else due

    def save_memory(self, progress: Progress) -> None:
        """A memory checkpoint of this boundary, unless the tier is still writing the previous one."""
        started = time.monotonic()
        self.promotion.save(self.state.gather(progress), (progress.step, progress.micro_step), started)
        self.schedule.memory_saved(progress.step, started)

    def promote(self) -> tuple[int, int] | None:
        """Write the newest memory state to disk now, from any thread (a request between
        boundaries): the step being written, or None. Not when a disk write is in flight, or the
        disk tier already has that step."""
        if self.promotion is None or self.hosts is not None or self.world > 1:  # several commit together, at boundaries
            return None
        return self.promotion.promote(self.data_skips)

    def save(self, progress: Progress, reason: str, *, wait: bool = False) -> bool | None:
        """Checkpoint `progress`; returns once staged (async: None) or written (sync or wait:
        whether it committed; a failure is reported, never raised)."""
        self.wait()
        existing = self.job_dir / mf.step_dir_name(progress.step, progress.micro_step)
        manifest = mf.read_manifest(existing)
        here = everywhere = manifest is not None and mf.is_global(existing, manifest)
        # The ranks' writers are done, but rank 0 writes the manifest last: a rank that looked
        # before it was there would save alone, waiting in collectives no other rank enters.
        if self.hosts is not None:
            # Each host judges its own part: one that restored a peer's memory state lacks the
            # disk part its peers hold, and must not commit alone while they skip.
            here = any(gang.gather_host(here, self.group))
            everywhere = all(gang.exchange(here, self.hosts, self.hosts_group))
        elif self.world > 1:
            here = everywhere = self.backend.any_rank(here)
        if here:
            manifest = manifest or mf.read_manifest(existing)
        if everywhere:  # e.g. the step this run resumed from
            self.writer.failures = 0
            self.emit(events.CheckpointCommitted(progress.step, progress.micro_step, reason, str(existing),
                                                 bytes=manifest.total_bytes if manifest else 0, seconds=0.0))
            return True
        started = time.monotonic()
        blocking = wait or not self.cfg.async_
        if here:  # this host's part is committed: it only joins the other hosts' global commit
            with self.writer.lock:
                self.writer.submit(None, progress.step, progress.micro_step, reason, started, self.data_skips)
            return self.wait() if blocking else None
        state = self.state.gather(progress)
        held = self._in_memory(state, progress, reason, started)
        if held is not None:  # written from the memory tier's copy: no second one
            staged, release = held.state, held.release
        else:  # a save the loop waits for anyway writes the live state; only async saves need a copy
            staged = self.backend.host_view(state) if blocking else self.backend.stage(state)
            release = None
        blocked = time.monotonic() - started
        self.schedule.saved(progress.step, blocked)
        self.last_saved_step = progress.step
        self.emit(events.CheckpointStarted(progress.step, progress.micro_step, reason, blocking_s=round(blocked, 4),
                                               waits=blocking))
        with self.writer.lock:
            self.writer.submit(staged, progress.step, progress.micro_step, reason, started, self.data_skips, release)
        return self.wait() if blocking else None

    def _in_memory(self, state: dict, progress: Progress, reason: str, started: float) -> mem.Held | None:
        """This boundary's state in the memory tier, held for a disk write; None without one."""
        if self.promotion is None:
            return None
        return self.promotion.held_for_disk(state, (progress.step, progress.micro_step), reason, started)

    def wait(self) -> bool | None:
        """Block until the save in flight, if any, is written: whether it committed (None: none was in flight)."""
        return self.writer.wait()

    def last_committed_step(self) -> int | None:
        committed = mf.committed_steps(self.job_dir)
        return committed[-1][0] if committed else None

    # --- restoring ---

    def restore(self, at_most: int | None = None) -> Progress | None:
        """Load the newest valid checkpoint of either tier (of step `at_most` or earlier) into the
        model and optimizer; None when there is none (engine.checkpoint.restore: a damaged one is
        moved aside and the next older one tried; it raises when none is left after a damaged
        one was loaded)."""
        if self.memory is not None:
            self.memory.wait()  # a state still being copied in is not yet there to restore
        restored = self.restorer.restore(at_most)
        if restored is None:
            return None
        progress = restored.progress
        if self.hosts is not None:
            # Steps the gang passed over (a host lacks them) would meet the next saves of those steps
            # as already committed on some hosts only, which then skip the commit's collectives.
            self._set_aside_after((progress.step, progress.micro_step),
                                  [f"the gang restored step {progress.step}, which every host holds"])
        self.last_saved_step, self.restored, self.restored_loader = progress.step, restored.manifest, restored.loader
        self.schedule.restored(progress.step)
        self.emit(events.CheckpointRestored(progress.step, progress.micro_step, str(restored.path),
                                            seconds=round(time.monotonic() - restored.started, 3)))
        return progress

    def forget_after(self, step: int) -> None:
        """A rollback undid the steps after `step` (engine.health.healing): the states that hold
        them, on disk (set aside in corrupt/) and in memory (dropped), are out of restore's way."""
        self._set_aside_after((step, 0), [f"a rollback to step {step} undid it"])

    def _set_aside_after(self, key: tuple[int, int], why: list[str]) -> None:
        for s, path, manifest in mf.committed_steps(self.job_dir):
            if (s, manifest.micro_step) > key:
                retention.move_aside(self.job_dir, path, why, self.rank, "checkpoint rolled back, moved aside")
        if self.memory is not None:
            for s, path, manifest in mf.parts(self.memory.job_dir):
                if (s, manifest.micro_step) > key:
                    self.memory.discard(path, why, "memory checkpoint rolled back, discarded")

    def close(self) -> None:
        self.writer.close()
        if self.memory is not None:
            self.memory.close()
