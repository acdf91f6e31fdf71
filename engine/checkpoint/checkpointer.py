"""Save and restore the whole training state with torch.distributed.checkpoint.

State: model and optimizer (DCP's FQN-keyed state dicts, sharded under SPMD), the loop's
progress (step, micro-step, tokens seen), the loss and gradients accumulated so far when
the save falls inside gradient accumulation, every RNG state, and the data loader's
geometry (its position is a pure function of the step). Resuming from it continues
exactly where the saved run was.

A save stages the state to host memory on the training thread (the only part the loop
waits for when async) and writes it from a background thread: DCP files into a
temporary directory, then manifest.json with sizes and CRC32C, then an atomic rename to
step_N. At most one save is in flight. Local retention never deletes the newest step or
one the supervisor has pinned while uploading it. An interval save is due every
interval_steps steps, and once interval_seconds have passed since the last save (`due`).

A save that fails (a full disk, an I/O error, a read-only or vanished directory, any DCP
error) is not fatal: its temporary directory is removed at once (it would hold the very
space the next save needs), a `checkpoint_failed` event says why, and training goes on to
try again at the next interval; `failures` counts them in a row. Before writing, when
the file system's free space is short of the last checkpoint's size, older committed
steps are deleted to make room (never the newest, never a pinned one).

The manifest also carries what must follow the checkpoint to another host but is not
tensor state: the loader's skipped batch ranges (`data_skips`, set by the trainer) and the
supervisor's wandb run id (TPUD_WANDB_RUN_ID in the worker's environment); and the job spec's
fingerprint (engine.spec.fingerprint), by which a job on several hosts refuses to resume a
checkpoint made with another spec.

With a memory tier (`memory_dir`, engine.checkpoint.memory) a state is copied into host shared
memory every checkpoint.memory.interval_steps steps; a disk save of a step the memory tier
holds (or can take) writes from there, so the loop waits for one copy only. A request that
arrives between boundaries (`promote`, from the hooks' listening thread) is answered at once by
writing the newest memory state to disk. Restore takes the newest valid state of both tiers.

A job on several hosts (`hosts`) saves each host's part into its own local tier and commits
it globally (engine.checkpoint.hosts): the commit event follows the global marker, and restore
takes the step the hosts agree on.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import structlog
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils._pytree import tree_flatten

from engine import events
from engine.backends.base import Backend
from engine.checkpoint import hosts as gang
from engine.checkpoint import manifest as mf
from engine.checkpoint import memory as mem
from engine.requests import Action, Request
from engine.spec import fingerprint as spec_fingerprint
from engine.spec.schema import CheckpointConfig
from engine.layout import fsync_path

log = structlog.get_logger()
Emit = Callable[[events.Event], None]
_WRITER_THREADS = 2  # DCP serialises and writes each file in its own thread; measured 1.3x faster than 1

# DCP warns on every single-process save by design, and its file writer trips torch's
# own TypedStorage deprecation; neither says anything about this checkpoint.
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning)


@dataclass
class Progress:
    """Where the loop stands: `micro_step` micro-batches of step `step` are accumulated."""

    step: int = 0
    micro_step: int = 0
    tokens_seen: int = 0
    loss_sum: torch.Tensor | None = None  # summed micro-batch losses of the current step


@functools.cache
def _version() -> str:
    try:
        return metadata.version("tpud")
    except metadata.PackageNotFoundError:
        return "unknown"


class Checkpointer:
    def __init__(self, cfg: CheckpointConfig, job: str, job_dir: Path, fingerprint: dict, backend: Backend,
                 model: nn.Module, optimizer: torch.optim.Optimizer, loader_state: dict, emit: Emit,
                 hosts: gang.Hosts | None = None, memory_dir: Path | None = None):
        self.cfg, self.job, self.fingerprint, self.hosts = cfg, job, fingerprint, hosts
        self.spec_hash = spec_fingerprint.digest(fingerprint)
        self.job_dir = Path(job_dir)  # this job's local tier (engine.layout.StateLayout.checkpoints)
        self.backend, self.model, self.optimizer = backend, model, optimizer
        self.loader_state, self._emit = loader_state, emit
        # Several hosts: each writes its own part, alone, into its own directory.
        self.group = None if hosts else backend.checkpoint_group
        self.hosts_group = backend.checkpoint_group if hosts else None
        self.rank = dist.get_rank() if dist.is_initialized() and not hosts else 0
        self.world = dist.get_world_size() if dist.is_initialized() and not hosts else 1
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._pending: Future | None = None
        self._submit_lock = threading.Lock()  # the disk writer: the training thread, and promote()'s
        self.data_skips: tuple[tuple[int, int], ...] = ()  # written into every manifest from now on
        self.wandb_run_id = os.environ.get("TPUD_WANDB_RUN_ID") or None
        self.restored: mf.Manifest | None = None  # the manifest of the checkpoint restore() loaded
        self.restored_loader: dict | None = None  # and the loader state it was saved with
        self.failures = 0  # saves that failed since the last commit
        self.last_saved_step: int | None = None
        self.last_save_time = time.monotonic()
        self.job_dir.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            self._remove_unfinished()
        self._create_optimizer_state()
        self.memory = self._memory_tier(memory_dir)
        self._memory_agreed: frozenset = frozenset()  # with several hosts: memory states every host holds
        self._names: list[str] | bool | None = None  # the optimizer's parameter names (_state_dicts); False: unused
        self._memory_budget: tuple[float | None, float] = (None, 0.0)  # (first memory save, seconds they held the loop)

    def _memory_tier(self, memory_dir: Path | None) -> mem.MemoryTier | None:
        cfg = self.cfg.memory
        if memory_dir is None or cfg is None or not cfg.interval_steps:
            return None
        if not self.backend.memory_tier or self.world > 1:
            log.info("no memory tier here", why="torch_xla's sharded state" if not self.backend.memory_tier
                     else "several processes on one host")
            return None
        # On a CPU the training threads use every core: the tier's work runs between steps instead.
        return mem.MemoryTier(Path(memory_dir) / self.job, self._describe, self._memory_committed,
                              self._memory_failed, background=self.backend.device.type != "cpu")

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
            hosts=self.hosts.count if self.hosts else 1)

    def _create_optimizer_state(self) -> None:
        """Create the optimizer's state now, exactly as its first step would.

        DCP's state-dict helper fills an empty optimizer's state with a zero-lr step, which
        also counts a step: a checkpoint taken before the first update would otherwise
        resume with a different step count, or hold no optimizer state at all. Doing it in
        every run, and resetting the counters, makes state creation part of the start.
        """
        get_state_dict(self.model, self.optimizer)
        for state in self.optimizer.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                step.zero_()
            elif step is not None:
                state["step"] = 0

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
        by_steps = self.cfg.interval_steps and step % self.cfg.interval_steps == 0
        by_time = self.cfg.interval_seconds and time.monotonic() - self.last_save_time >= self.cfg.interval_seconds
        if self.cfg.interval_seconds and not by_steps:
            # Each rank reads its own clock: they agree, or one rank alone would enter the save's collectives.
            by_time = self.backend.agree(Request(Action.CHECKPOINT) if by_time else None) is not None
        return bool(by_steps or by_time)

    def memory_due(self, step: int) -> bool:
        """Whether the memory tier saves at this step: every interval_steps steps, while the time
        its saves held the loop stays within max_overhead of the time since the first. No
        collective: each host's tier is its own."""
        if self.memory is None or step % self.cfg.memory.interval_steps:
            return False
        since, spent = self._memory_budget
        return since is None or spent <= self.cfg.memory.max_overhead * (time.monotonic() - since)

    def save_memory(self, progress: Progress) -> None:
        """A memory checkpoint of this boundary, unless the tier is still writing the previous one."""
        started = time.monotonic()
        held = self.memory.save(self._state(progress), (progress.step, progress.micro_step), "interval", started)
        if held is not None:
            held.release()
        since, spent = self._memory_budget
        self._memory_budget = (since or started, spent + time.monotonic() - started)

    def _memory_committed(self, key: tuple[int, int], path: Path, manifest: mf.Manifest, started: float) -> None:
        self.emit(events.CheckpointCommitted(key[0], key[1], "interval", str(path), bytes=manifest.total_bytes,
                                             seconds=round(time.monotonic() - started, 4), tier="memory"))

    def _memory_failed(self, key: tuple[int, int], error: str) -> None:
        self.emit(events.CheckpointFailed(key[0], key[1], "interval", error, 1, str(self.memory.job_dir),
                                          tier="memory"))

    def promote(self) -> tuple[int, int] | None:
        """Write the newest memory state to disk now, from any thread (a request between
        boundaries): the step being written, or None. Not when a disk write is in flight, or the
        disk tier already has that step."""
        if self.memory is None or self.hosts is not None:  # several hosts commit together, at boundaries
            return None
        key, on_disk = self.memory.newest, self.last_committed_step()
        if key is None or (on_disk is not None and key[0] <= on_disk):
            return None
        with self._submit_lock:
            if self._pending is not None and not self._pending.done():
                return None
            held = self.memory.hold(key)
            if held is None:
                return None
            log.info("writing the newest memory checkpoint to disk", step=key[0], micro_step=key[1])
            self._pending = self._writer.submit(self._write, held.state, key[0], key[1], "request",
                                                time.monotonic(), self.data_skips, held.release)
        return key

    def _state_dicts(self) -> tuple[dict, dict]:
        """get_state_dict's model and optimizer state dicts. With a memory tier they are taken every
        step, and get_state_dict's per-call name lookups cost more than a small model's step: after
        a first call that proves them equal, they come from the plain state dicts and its names."""
        if self.memory is None or self._names is False:
            return get_state_dict(self.model, self.optimizer)
        if self._names is None:
            model_state, optim_state = get_state_dict(self.model, self.optimizer)
            by_id = {id(p): name for name, p in self.model.named_parameters()}
            names = [by_id.get(id(p)) for group in self.optimizer.param_groups for p in group["params"]]
            self._names = names if None not in names and _same((model_state, optim_state),
                                                               self._plain_state_dicts(names)) else False
            return model_state, optim_state
        return self._plain_state_dicts(self._names)

    def _plain_state_dicts(self, names: list[str]) -> tuple[dict, dict]:
        plain = self.optimizer.state_dict()  # keyed by the parameters' places in the groups
        return self.model.state_dict(), {
            "state": {names[i]: value for i, value in plain["state"].items()},
            "param_groups": [{**group, "params": [names[i] for i in group["params"]]} for group in plain["param_groups"]]}

    def _state(self, progress: Progress) -> dict:
        model_state, optim_state = self._state_dicts()
        state = {
            "model": model_state,
            "optim": optim_state,
            "progress": {"step": progress.step, "micro_step": progress.micro_step,
                         "tokens_seen": progress.tokens_seen},
            "rng": self.backend.rng_state(),
            "loader": dict(self.loader_state),
        }
        if progress.micro_step:
            # Inside gradient accumulation: the partial gradients and loss are state too.
            state["partial"] = {"loss_sum": progress.loss_sum.detach(),
                                "grads": {n: p.grad for n, p in self.model.named_parameters()}}
        return state

    def save(self, progress: Progress, reason: str, *, wait: bool = False) -> bool | None:
        """Checkpoint `progress`; returns once staged (async: None) or written (sync or wait:
        whether it committed; a failure is reported, never raised)."""
        self.wait()
        existing = self.job_dir / mf.step_dir_name(progress.step, progress.micro_step)
        manifest = mf.read_manifest(existing)
        if manifest is not None and mf.is_global(existing, manifest):  # e.g. the step this run resumed from
            self.failures = 0
            self.emit(events.CheckpointCommitted(progress.step, progress.micro_step, reason, str(existing),
                                                 bytes=manifest.total_bytes, seconds=0.0))
            return True
        started = time.monotonic()
        blocking = wait or not self.cfg.async_
        state = self._state(progress)
        held = self._in_memory(state, progress, reason, started)
        if held is not None:  # written from the memory tier's copy: no second one
            staged, release = held.state, held.release
        else:  # a save the loop waits for anyway writes the live state; only async saves need a copy
            staged = self.backend.host_view(state) if blocking else self.backend.stage(state)
            release = None
        blocked = time.monotonic() - started
        self.last_save_time, self.last_saved_step = time.monotonic(), progress.step
        self.emit(events.CheckpointStarted(progress.step, progress.micro_step, reason, blocking_s=round(blocked, 4)))
        with self._submit_lock:
            self._pending = self._writer.submit(self._write, staged, progress.step, progress.micro_step, reason,
                                                started, self.data_skips, release)
        return self.wait() if blocking else None

    def _in_memory(self, state: dict, progress: Progress, reason: str, started: float) -> mem.Held | None:
        """This boundary's state in the memory tier, held for a disk write; None without one."""
        if self.memory is None:
            return None
        key = (progress.step, progress.micro_step)
        self.memory.wait()  # a memory save of this very step may still be committing
        return self.memory.hold(key) or self.memory.save(state, key, reason, started)

    def wait(self) -> bool | None:
        """Block until the save in flight, if any, is written: whether it committed (None: none was in flight)."""
        with self._submit_lock:
            pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def _write(self, staged: dict, step: int, micro_step: int, reason: str, started: float,
               data_skips: tuple[tuple[int, int], ...], release: Callable[[], None] | None = None) -> bool:
        try:
            return self._write_to_disk(staged, step, micro_step, reason, started, data_skips)
        finally:
            if release is not None:
                release()

    def _write_to_disk(self, staged: dict, step: int, micro_step: int, reason: str, started: float,
                       data_skips: tuple[tuple[int, int], ...]) -> bool:
        final = self.job_dir / mf.step_dir_name(step, micro_step)
        tmp = self.job_dir / f".tmp-{final.name}"
        try:
            if self.rank == 0:
                self._prepare(tmp, staged)
            save_planner, _ = self.backend.planners()
            writer = dcp.FileSystemWriter(tmp, sync_files=True, thread_count=_WRITER_THREADS)
            dcp.save(staged, storage_writer=writer, planner=save_planner,
                     process_group=self.group, no_dist=self.group is None)
            if self.rank == 0:
                manifest = self._describe(tmp, step, micro_step, reason, data_skips=data_skips)
                mf.write_manifest(tmp, manifest)
                if final.exists():  # not committed there (save() looked): a leftover, never trusted
                    self._move_aside(final, ["not committed"])
                tmp.rename(final)  # committed (its host's part, with several): nothing after this may fail the save
            error = None
        # CheckpointException is a BaseException: DCP's way of carrying every rank's failure.
        except (Exception, CheckpointException) as e:  # a failed save must never end the run (module docstring)
            shutil.rmtree(tmp, ignore_errors=True)  # every rank: DCP's failure reaches all of them
            error = describe_error(e)
        if self.hosts is not None:
            error = self._commit_globally(final, manifest if error is None else None, error)
        if error is not None:
            self.failures += 1
            self.emit(events.CheckpointFailed(step, micro_step, reason, error, self.failures, str(self.job_dir)))
            return False
        self.failures = 0
        if self.rank == 0:
            try:
                fsync_path(self.job_dir)
                self._retain()
            except OSError as e:  # the step is committed; only its durability or retention is in doubt
                log.warning("after a commit", path=str(final), error=describe_error(e))
            self.emit(events.CheckpointCommitted(step, micro_step, reason, str(final), bytes=manifest.total_bytes,
                                                 seconds=round(time.monotonic() - started, 3)))
        return True

    def _commit_globally(self, final: Path, manifest: mf.Manifest | None, error: str | None) -> str | None:
        """Every host's outcome, then the global marker if all parts are durable: why not, or None.

        Every host takes part even when its own part failed: the others wait for its answer.
        """
        held = frozenset((step, m.micro_step) for step, _, m in mf.parts(self.job_dir))
        try:
            outcomes = gang.exchange((error, held), self.hosts, self.hosts_group)
        except Exception as e:  # noqa: BLE001  (a peer died mid-save: its part is unknown)
            return error or f"the global commit failed: {describe_error(e)}"
        self._record_holdings([parts for _, parts in outcomes])
        if error is not None:
            return error
        failed = {host: outcome for host, (outcome, _) in enumerate(outcomes) if outcome is not None}
        if failed:
            return "; ".join(f"host {host} could not write its part: {why}" for host, why in failed.items())
        try:
            mf.write_global(final, manifest)
        except OSError as e:  # the peers' markers stand; restore's agreement covers this host's lack of one
            return f"the global marker: {describe_error(e)}"
        return None

    def _prepare(self, tmp: Path, staged: dict) -> None:
        """Rank 0, before writing: clear the way. Never raises: every rank must reach DCP's
        collectives, and a real problem (a read-only disk) fails the save there, on all ranks."""
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            self._make_room(staged)
        except Exception as e:  # noqa: BLE001
            log.warning("could not make room for a checkpoint", path=str(self.job_dir), error=describe_error(e))

    def _retain(self) -> None:
        committed = mf.committed_steps(self.job_dir)
        pinned = mf.pinned_steps(self.job_dir)
        for step, path, _ in committed[: max(0, len(committed) - self.cfg.keep)]:
            if step not in pinned:
                shutil.rmtree(path, ignore_errors=True)
        if committed and self.hosts is not None:
            # Parts whose global commit failed, older than this host's newest global step: never restored.
            newest = (committed[-1][0], committed[-1][2].micro_step)
            for step, path, manifest in mf.parts(self.job_dir):
                if (step, manifest.micro_step) < newest and not mf.is_global(path, manifest) and step not in pinned:
                    shutil.rmtree(path, ignore_errors=True)

    def last_committed_step(self) -> int | None:
        committed = mf.committed_steps(self.job_dir)
        return committed[-1][0] if committed else None

    def _make_room(self, staged: dict) -> None:
        """Delete older committed steps (oldest first; never the newest or a pinned one) while the
        file system has less free space than this save is expected to need."""
        committed = mf.committed_steps(self.job_dir)
        need = committed[-1][2].total_bytes if committed else _nbytes(staged) * self.world
        need = int(need * 1.05) + (1 << 20)  # DCP's metadata, the manifest, file system blocks
        pinned = mf.pinned_steps(self.job_dir)
        for step, path, _ in committed[:-1]:
            free = shutil.disk_usage(self.job_dir).free
            if free >= need:
                return
            if step not in pinned:
                log.warning("deleting an older checkpoint to make room", path=str(path), free_bytes=free,
                            need_bytes=need)
                shutil.rmtree(path, ignore_errors=True)

    def _remove_unfinished(self) -> None:
        """Temporary directories of saves that were killed: never committed, so never used."""
        for tmp in self.job_dir.glob(".tmp-step_*"):
            log.info("removing an unfinished checkpoint", path=str(tmp))
            shutil.rmtree(tmp, ignore_errors=True)

    # --- restoring ---

    def _move_aside(self, path: Path, found: list[str]) -> None:
        aside = self.job_dir / "corrupt" / f"{path.name}.{int(time.time())}"
        log.warning("checkpoint failed verification, moved aside", path=str(path), problems=found,
                    moved_to=str(aside))
        if self.rank == 0:
            aside.parent.mkdir(exist_ok=True)
            path.rename(aside)

    def restore(self) -> Progress | None:
        """Load the newest valid checkpoint into the model and optimizer; None when there is none.

        Every file's CRC32C is checked while DCP loads (both read the same files, so the
        second read comes from the page cache), and the state is applied only once the check
        passes; a damaged checkpoint is moved aside and the next older one loaded, which
        overwrites every tensor the damaged one touched. Copies are not made: they would
        double the state's memory. If no valid checkpoint is left after a damaged one was
        loaded, the process must not train on that state: it raises, and a restart begins
        afresh.
        """
        tainted = False
        candidates = mf.committed_steps(self.job_dir) if self.hosts is None else self._agreed_part()
        in_memory = self._memory_states(candidates)
        # Newest first; of two copies of a step, the memory one (read at memory speed).
        ordered = sorted([(item, False) for item in candidates] + [(item, True) for item in in_memory],
                         key=lambda c: (c[0][0], c[0][2].micro_step, c[1]), reverse=True)
        for (_, path, manifest), from_memory in ordered:
            if from_memory:
                restored = self._restore_memory(path, manifest)
                if restored is not None:
                    return restored
                continue
            found = mf.problems(path, manifest, checksums=False)
            if found:
                self._move_aside(path, found)
                continue
            started = time.monotonic()
            verifying = self._writer.submit(mf.problems, path, manifest, checksums=True)
            try:
                template = self._load(path, manifest)
            except Exception as e:  # unreadable despite matching sizes: judged by its checksums below
                template, error = None, e
            found = verifying.result()
            if found:
                self._move_aside(path, found)
                tainted = True
                continue
            if template is None:
                raise error
            return self._apply(template, manifest, path, started)
        if tainted:
            raise RuntimeError("every checkpoint failed verification (moved aside); restart to begin afresh")
        return None

    def _memory_states(self, on_disk: list[tuple[int, Path, mf.Manifest]]) -> list[tuple[int, Path, mf.Manifest]]:
        """The memory tier's states worth trying: as new as the disk's newest candidate or newer, and with
        several hosts, held by every host (the agreement put it in `self._memory_agreed`)."""
        if self.memory is None:
            return []
        newest = max(((step, m.micro_step) for step, _, m in on_disk), default=(-1, -1))
        held = [(step, path, m) for step, path, m in mf.parts(self.memory.job_dir) if (step, m.micro_step) >= newest]
        if self.hosts is not None:
            held = [item for item in held if (item[0], item[2].micro_step) in self._memory_agreed]
        return held

    def _restore_memory(self, path: Path, manifest: mf.Manifest) -> Progress | None:
        """Load a memory state once every byte matches its manifest; None (and the state discarded) otherwise."""
        started = time.monotonic()
        found = mf.problems(path, manifest, checksums=True)
        if not found:
            try:
                template = mem.load(path, self._template(manifest))
            except (OSError, ValueError, KeyError, TypeError) as e:
                found = [describe_error(e)]
            else:
                return self._apply(template, manifest, path, started)
        self.memory.discard(path, found)
        return None

    def _agreed_part(self) -> list[tuple[int, Path, mf.Manifest]]:
        """This host's part of the step every host restores (engine.checkpoint.hosts), marked
        global here too; none when the hosts have no step in common."""
        held = {(step, m.micro_step): (step, path, m) for step, path, m in mf.parts(self.job_dir)
                if not mf.problems(path, m, checksums=False)}
        mine = gang.Holdings(frozenset(held), frozenset(k for k, (_, p, m) in held.items() if mf.is_global(p, m)))
        # Verified before they are offered: every host must restore the step it agreed to.
        in_memory = frozenset((step, m.micro_step) for step, path, m in mf.parts(self.memory.job_dir)
                              if m.hosts == self.hosts.count and not mf.problems(path, m, checksums=True)
                              ) if self.memory is not None else frozenset()
        everyone = gang.exchange((mine, {k: m.hosts for k, (_, _, m) in held.items()}, in_memory,
                                  self.memory is not None), self.hosts, self.hosts_group)
        memories, tiers = [memory for _, _, memory, _ in everyone], [tier for *_, tier in everyone]
        # A state every host holds in memory (each verifies its own) may restore them all.
        self._memory_agreed = frozenset.intersection(*memories)
        everyone = [(h, made) for h, made, _, _ in everyone]
        hosts_of = {k: n for _, made in everyone for k, n in made.items()}
        self._record_holdings([h.parts for h, _ in everyone])
        key, passed = gang.choose([h for h, _ in everyone], self.hosts.count, hosts_of)
        if passed:
            log.warning("newer global checkpoints passed over", reasons=passed, restoring=key)
        if not self._memory_agreed and all(tiers):
            self._memory_from_peer(memories, key)
        if key is None:
            if any(h.marked for h, _ in everyone) and not self._memory_agreed:
                raise RuntimeError(f"no globally committed step is held by every host ({'; '.join(passed)}); "
                                   "give the job a checkpoint.remote so a host can fetch its part")
            return []
        step, path, manifest = held[key]
        if not mf.is_global(path, manifest):
            mf.write_global(path, manifest)
        return [held[key]]

    def _memory_from_peer(self, memories: list[frozenset], on_disk: tuple[int, int] | None) -> None:
        """Hosts whose memory states are gone (a replaced VM) take the newest state that every other
        host holds, newer than the step the disks agree on, from one of them. The engine's state is
        replicated across hosts (data parallelism), so a peer's state is this host's too. Every
        host computes the same plan from the exchange; the receivers' checks are agreed again."""
        empty = [i for i, memory in enumerate(memories) if not memory]
        holding = [memory for memory in memories if memory]
        common = frozenset.intersection(*holding) if holding else frozenset()
        newer = sorted(k for k in common if on_disk is None or k > on_disk)
        if not empty or not newer:
            return
        key = newer[-1]
        source = next(i for i, memory in enumerate(memories) if key in memory)
        received = self.memory.transfer(key, source, empty, self.hosts.index, self.hosts_group)
        if all(gang.exchange(received, self.hosts, self.hosts_group)):
            log.info("a peer's memory state restores the hosts that lost theirs", step=key[0], micro_step=key[1],
                     source=source, hosts=empty)
            self._memory_agreed = frozenset({key})

    def _record_holdings(self, parts_by_host: list[frozenset]) -> None:
        try:
            gang.record_holdings(self.job_dir, parts_by_host)
        except OSError as e:  # it only informs `tpud checkpoints`
            log.warning("could not record which host holds which part", path=str(self.job_dir),
                        error=describe_error(e))

    def _template(self, manifest: mf.Manifest) -> dict:
        """A state of the manifest's shape for a load to fill: the live tensors, and fresh ones for
        a partial step's accumulated values."""
        progress = Progress(step=manifest.step, micro_step=manifest.micro_step,
                            loss_sum=torch.zeros((), device=self.backend.device))
        self._state(progress)  # creates the optimizer's state, to be laid out before loading into it
        grads = {n: torch.zeros_like(p) for n, p in self.model.named_parameters()} if manifest.micro_step else {}
        self.backend.shard_like_weights(self.model, self.optimizer, grads)
        template = self._state(progress)
        if grads:
            template["partial"]["grads"] = grads
        return template

    def _load(self, path: Path, manifest: mf.Manifest) -> dict:
        template = self._template(manifest)
        _, load_planner = self.backend.planners()
        dcp.load(template, storage_reader=dcp.FileSystemReader(path), planner=load_planner,
                 process_group=self.group, no_dist=self.group is None)
        return template

    def _apply(self, template: dict, manifest: mf.Manifest, path: Path, started: float) -> Progress:
        set_state_dict(self.model, self.optimizer, model_state_dict=template["model"],
                       optim_state_dict=template["optim"])
        self.backend.set_rng_state(template["rng"])
        if template["loader"] != self.loader_state:
            log.warning("data geometry changed since the checkpoint; batches will differ from the saved run",
                        saved=template["loader"], now=self.loader_state)
        progress = Progress(**template["progress"])
        if manifest.micro_step:
            for name, param in self.model.named_parameters():
                param.grad = template["partial"]["grads"][name]
            progress.loss_sum = template["partial"]["loss_sum"]
        self.last_saved_step, self.restored, self.restored_loader = progress.step, manifest, dict(template["loader"])
        self.emit(events.CheckpointRestored(progress.step, progress.micro_step, str(path),
                                            seconds=round(time.monotonic() - started, 3)))
        return progress

    def close(self) -> None:
        self.wait()
        self._writer.shutdown()
        if self.memory is not None:
            self.memory.close()


def _same(a: object, b: object) -> bool:
    """Whether two state trees have one structure, the same values, and tensors over the same memory."""
    leaves_a, spec_a = tree_flatten(a)
    leaves_b, spec_b = tree_flatten(b)
    if spec_a != spec_b:
        return False
    for x, y in zip(leaves_a, leaves_b):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if (x.shape, x.dtype, x.device) != (y.shape, y.dtype, y.device) or x.data_ptr() != y.data_ptr():
                return False
        elif x != y:
            return False
    return True


def _nbytes(state: object) -> int:
    """Bytes of the tensors in a (nested) state dict."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_nbytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_nbytes(v) for v in state)
    return 0


def describe_error(error: BaseException) -> str:
    """One line for the operator: the operating system's reason when there is one under DCP's wrapping."""
    seen: list[BaseException] = []
    todo = [error]
    while todo and len(seen) < 32:
        e = todo.pop(0)
        if e in seen:
            continue
        seen.append(e)
        if isinstance(e, OSError) and e.errno:
            code = errno.errorcode.get(e.errno, str(e.errno))
            where = f": {e.filename}" if e.filename else ""
            return f"{e.strerror or os.strerror(e.errno)} ({code}){where}"
        # DCP's CheckpointException keeps each rank's exception in `failures` (with its traceback).
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values() if f is not None]
        todo += [x for x in (e.__cause__, e.__context__) if x is not None]
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= 300 else text[:297] + "..."
