"""Writing a staged state into the local tier, on a background thread, at most one at a time.

DCP files into a temporary directory, then manifest.json with sizes and CRC32C, then an atomic
rename to step_N; with several hosts, the global commit (engine.checkpoint.hosts) follows, and
the commit event waits for it. A write that fails (a full disk, an I/O error, a read-only or
vanished directory, any DCP error) is not fatal: its temporary directory is removed at once (it
would hold the very space the next save needs), a `checkpoint_failed` event says why, and
`failures` counts them in a row. Before writing, room is made (engine.checkpoint.retention);
after a commit, older steps are retired.
"""

from __future__ import annotations

import shutil
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import structlog
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from engine import events
from engine.backends.base import Backend
from engine.checkpoint import hosts as gang
from engine.checkpoint import manifest as mf
from engine.checkpoint import retention
from engine.checkpoint.errors import describe_error
from engine.layout import fsync_path
from engine.side_threads import side_thread

log = structlog.get_logger()
_WRITER_THREADS = 2  # DCP serialises and writes each file in its own thread; measured 1.3x faster than 1

# DCP warns on every single-process save by design, and its file writer trips torch's
# own TypedStorage deprecation; neither says anything about this checkpoint.
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning)

# (directory, step, micro_step, reason, data_skips=...) -> its manifest, checksummed
Describe = Callable[..., mf.Manifest]


class DiskWriter:
    def __init__(self, job_dir: Path, keep: int, backend: Backend, group: Any, rank: int, world: int,
                 hosts: gang.Hosts | None, hosts_group: Any, describe: Describe,
                 emit: Callable[[events.Event], None]):
        self.job_dir, self.keep, self.backend = job_dir, keep, backend
        self.group, self.rank, self.world = group, rank, world
        self.hosts, self.hosts_group = hosts, hosts_group
        self._describe, self._emit = describe, emit
        self.pool = side_thread("checkpoint-writer")
        self._pending: Future | None = None
        self.lock = threading.Lock()  # submitting: the training thread, and a promotion's (any thread)
        self.failures = 0  # saves that failed since the last commit

    def busy(self) -> bool:
        """A write is in flight (the caller holds `lock`)."""
        return self._pending is not None and not self._pending.done()

    def submit(self, staged: dict | None, step: int, micro_step: int, reason: str, started: float,
               data_skips: tuple[tuple[int, int], ...], release: Callable[[], None] | None = None) -> None:
        """Write `staged` in the background, then call `release` (the caller holds `lock`). None: this
        host's part of the step is committed already, and only the other hosts' global commit is
        joined."""
        self._pending = self.pool.submit(self._write, staged, step, micro_step, reason, started, data_skips, release)

    def wait(self) -> bool | None:
        """Block until the write in flight, if any, ends: whether it committed (None: none was in flight)."""
        with self.lock:
            pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def _write(self, staged: dict, step: int, micro_step: int, reason: str, started: float,
               data_skips: tuple[tuple[int, int], ...], release: Callable[[], None] | None = None) -> bool:
        try:
            return self._write_to_disk(staged, step, micro_step, reason, started, data_skips)
        finally:
            if release is not None:
                release()

    def _write_to_disk(self, staged: dict | None, step: int, micro_step: int, reason: str, started: float,
                       data_skips: tuple[tuple[int, int], ...]) -> bool:
        final = self.job_dir / mf.step_dir_name(step, micro_step)
        tmp = self.job_dir / f".tmp-{final.name}"
        manifest = None  # rank 0's: it writes it
        try:
            if staged is None:
                manifest = self._committed_part(final)
            else:
                manifest = self._write_part(staged, final, tmp, step, micro_step, reason, data_skips)
            error = None
        # CheckpointException is a BaseException: DCP's way of carrying every rank's failure.
        except (Exception, CheckpointException) as e:  # a failed save must never end the run (module docstring)
            shutil.rmtree(tmp, ignore_errors=True)  # every rank: DCP's failure reaches all of them
            error = describe_error(e)
        if self.hosts is not None:
            error = self._commit_globally(final, manifest if error is None else None, error)
        if error is not None:
            self.failures += 1
            self._emit(events.CheckpointFailed(step, micro_step, reason, error, self.failures, str(self.job_dir)))
            return False
        self.failures = 0
        if self.rank == 0:
            try:
                fsync_path(self.job_dir)
                retention.retain(self.job_dir, self.keep, self.hosts is not None)
            except OSError as e:  # the step is committed; only its durability or retention is in doubt
                log.warning("after a commit", path=str(final), error=describe_error(e))
            self._emit(events.CheckpointCommitted(step, micro_step, reason, str(final), bytes=manifest.total_bytes,
                                                  seconds=round(time.monotonic() - started, 3)))
        return True

    def _write_part(self, staged: dict, final: Path, tmp: Path, step: int, micro_step: int, reason: str,
                    data_skips: tuple[tuple[int, int], ...]) -> mf.Manifest | None:
        """DCP files, then the manifest, then the rename that commits (this host's part, with
        several): rank 0's manifest, None on the other ranks."""
        manifest = None
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
                retention.move_aside(self.job_dir, final, ["not committed"], self.rank)
            tmp.rename(final)  # committed: nothing after this may fail the save
        return manifest

    def _committed_part(self, final: Path) -> mf.Manifest | None:
        """The manifest of this host's part, committed before (rank 0's; None on the other ranks)."""
        if self.rank != 0:
            return None
        manifest = mf.read_manifest(final)
        if manifest is None:
            raise FileNotFoundError(f"{final}: this host's committed part vanished before the global commit")
        return manifest

    def _commit_globally(self, final: Path, manifest: mf.Manifest | None, error: str | None) -> str | None:
        """Every host's outcome, then the global marker if all parts are durable: why not, or None.

        Every host takes part even when its own part failed: the others wait for its answer. A
        host of several processes (`group`) first agrees on its own outcome (the manifest, the
        rename and the marker are its rank 0's), and all of them return rank 0's verdict.
        """
        held = frozenset((step, m.micro_step) for step, _, m in mf.parts(self.job_dir))
        try:
            error = next((e for e in gang.gather_host(error, self.group) if e is not None), None)
            outcomes = gang.exchange((error, held), self.hosts, self.hosts_group)
        except Exception as e:  # noqa: BLE001  (a peer died mid-save: its part is unknown)
            return error or f"the global commit failed: {describe_error(e)}"
        if self.rank == 0:
            gang.note_holdings(self.job_dir, [parts for _, parts in outcomes])
            error = error or self._mark_global(final, manifest, outcomes)
        try:
            return gang.from_host_rank_0(error, self.group)
        except Exception as e:  # noqa: BLE001  (rank 0 died after the exchange)
            return error or f"the global commit failed: {describe_error(e)}"

    def _mark_global(self, final: Path, manifest: mf.Manifest, outcomes: list) -> str | None:
        """The global marker, when every host's part is durable and the gang is still this host's."""
        failed = {host: outcome for host, (outcome, _) in enumerate(outcomes) if outcome is not None}
        if failed:
            return "; ".join(f"host {host} could not write its part: {why}" for host, why in failed.items())
        if self.hosts.fence is not None and (why := self.hosts.fence()) is not None:
            return f"fenced: {why}"
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
            retention.make_room(self.job_dir, staged, self.world)
        except Exception as e:  # noqa: BLE001
            log.warning("could not make room for a checkpoint", path=str(self.job_dir), error=describe_error(e))

    def close(self) -> None:
        self.wait()
        self.pool.shutdown()
