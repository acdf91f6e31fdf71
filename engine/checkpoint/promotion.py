"""The memory tier (engine.checkpoint.memory) in front of the disk's.

A state is copied into host shared memory every checkpoint.memory.interval_steps steps; a disk
save of a step the memory tier holds (or can take) writes from there, so the loop waits for one
copy only. A request that arrives between boundaries is answered at once by promoting the newest
memory state: writing it to disk.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import structlog

from engine import events
from engine.backends.base import Backend
from engine.checkpoint import manifest as mf
from engine.checkpoint import memory as mem
from engine.checkpoint.writer import DiskWriter
from engine.spec.schema import CheckpointConfig

log = structlog.get_logger()


def memory_tier(cfg: CheckpointConfig, backend: Backend, world: int, rank: int, memory_dir: Path | None, job: str,
                describe: mem.Describe, emit: Callable[[events.Event], None]) -> mem.MemoryTier | None:
    """This job's memory tier, when the job has one and this process can keep it. The processes of
    one host (world > 1) each keep their own shards, in a directory of their own."""
    if memory_dir is None or cfg.memory is None or not cfg.memory.interval_steps:
        return None
    if not backend.memory_tier:
        log.info("no memory tier here", why="torch_xla's sharded state")
        return None
    job_dir = Path(memory_dir) / job / (f"rank-{rank}" if world > 1 else "")

    def committed(key: mem.Key, path: Path, manifest: mf.Manifest, started: float) -> None:
        emit(events.CheckpointCommitted(key[0], key[1], "interval", str(path), bytes=manifest.total_bytes,
                                        seconds=round(time.monotonic() - started, 4), tier="memory"))

    def failed(key: mem.Key, error: str) -> None:
        emit(events.CheckpointFailed(key[0], key[1], "interval", error, 1, str(job_dir), tier="memory"))

    # On a CPU the training threads use every core: the tier's work runs between steps instead.
    return mem.MemoryTier(job_dir, describe, committed, failed, background=backend.device.type != "cpu")


class Promotion:
    def __init__(self, memory: mem.MemoryTier, writer: DiskWriter, last_committed_step: Callable[[], int | None]):
        self.memory, self.writer, self._last_committed_step = memory, writer, last_committed_step

    def save(self, state: dict, key: mem.Key, started: float) -> None:
        """An interval memory checkpoint, unless the tier is still writing the previous one."""
        held = self.memory.save(state, key, "interval", started)
        if held is not None:
            held.release()

    def held_for_disk(self, state: dict, key: mem.Key, reason: str, started: float) -> mem.Held | None:
        """This boundary's state in the memory tier, held for a disk write; None when it cannot be."""
        self.memory.wait()  # a memory save of this very step may still be committing
        return self.memory.hold(key) or self.memory.save(state, key, reason, started)

    def promote(self, data_skips: tuple[tuple[int, int], ...]) -> mem.Key | None:
        """Write the newest memory state to disk now, from any thread: its key, or None. Not when a
        disk write is in flight, or the disk tier already has that step."""
        key, on_disk = self.memory.newest, self._last_committed_step()
        if key is None or (on_disk is not None and key[0] <= on_disk):
            return None
        with self.writer.lock:
            if self.writer.busy():
                return None
            held = self.memory.hold(key)
            if held is None:
                return None
            log.info("writing the newest memory checkpoint to disk", step=key[0], micro_step=key[1])
            self.writer.submit(held.state, key[0], key[1], "request", time.monotonic(), data_skips, held.release)
        return key
