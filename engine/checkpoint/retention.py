"""What the local tier keeps: the newest `checkpoint.keep` committed steps, room made for the next
save when the disk is short of it, and nothing a killed save or a failed verification left.

Never deleted: the newest committed step, and a step the supervisor has pinned while uploading
it (engine.checkpoint.manifest.pinned_steps).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import structlog

from engine.checkpoint import manifest as mf
from engine.checkpoint.state import nbytes

log = structlog.get_logger()


def retain(job_dir: Path, keep: int, several_hosts: bool) -> None:
    """After a commit: the older steps beyond `keep` go, and with several hosts, parts whose
    global commit failed."""
    committed = mf.committed_steps(job_dir)
    pinned = mf.pinned_steps(job_dir)
    for step, path, _ in committed[: max(0, len(committed) - keep)]:
        if step not in pinned:
            shutil.rmtree(path, ignore_errors=True)
    if committed and several_hosts:
        # Parts whose global commit failed, older than this host's newest global step: never restored.
        newest = (committed[-1][0], committed[-1][2].micro_step)
        for step, path, manifest in mf.parts(job_dir):
            if (step, manifest.micro_step) < newest and not mf.is_global(path, manifest) and step not in pinned:
                shutil.rmtree(path, ignore_errors=True)


def make_room(job_dir: Path, staged: dict, world: int) -> None:
    """Delete older committed steps (oldest first; never the newest or a pinned one) while the
    file system has less free space than this save is expected to need."""
    committed = mf.committed_steps(job_dir)
    need = committed[-1][2].total_bytes if committed else nbytes(staged) * world
    need = int(need * 1.05) + (1 << 20)  # DCP's metadata, the manifest, file system blocks
    pinned = mf.pinned_steps(job_dir)
    for step, path, _ in committed[:-1]:
        free = shutil.disk_usage(job_dir).free
        if free >= need:
            return
        if step not in pinned:
            log.warning("deleting an older checkpoint to make room", path=str(path), free_bytes=free,
                        need_bytes=need)
            shutil.rmtree(path, ignore_errors=True)


def remove_unfinished(job_dir: Path) -> None:
    """Temporary directories of saves that were killed: never committed, so never used."""
    for tmp in job_dir.glob(".tmp-step_*"):
        log.info("removing an unfinished checkpoint", path=str(tmp))
        shutil.rmtree(tmp, ignore_errors=True)


def move_aside(job_dir: Path, path: Path, found: list[str], rank: int,
               what: str = "checkpoint failed verification, moved aside") -> None:
    """A step that failed verification (or was never committed, or a rollback undid) goes to
    corrupt/, out of restore's way; rank 0 moves it, every rank logs it."""
    aside = job_dir / "corrupt" / f"{path.name}.{int(time.time())}"
    log.warning(what, path=str(path), problems=found, moved_to=str(aside))
    if rank == 0:
        aside.parent.mkdir(exist_ok=True)
        path.rename(aside)
