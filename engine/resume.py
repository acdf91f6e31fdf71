"""What a trainer resumes from besides a checkpoint, and what it checks of one.

A gang that changes in place (tpud/worker/gang/) keeps each survivor's model and optimizer
(`Warm`), and a host that joins a live gang, or a survivor a step behind, takes the newest live
state from the rank that holds it (`take_live_state`). A checkpoint resumes only with the teacher
it was distilled from and the data it was trained on, unless the job allows the change.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import structlog
import torch

from engine.checkpoint.checkpointer import Progress
from engine.data.skips import Skips, regeometry
from engine.errors import ConfigError
from engine.models.llama import Transformer
from engine.spec.schema import DataConfig

log = structlog.get_logger()


@dataclass
class Warm:
    """What a worker keeps when its gang changes in place: the model (its compiled code with it),
    the optimizer and where the loop stood. Everything sized by the gang is built anew."""

    model: Transformer
    optimizer: torch.optim.Optimizer
    progress: Progress
    skips: list                 # the loader's, in micro-batches of `per_micro_batch` samples
    per_micro_batch: int
    teacher: Transformer | None = None

    def skips_for(self, per_micro_batch: int) -> Skips:
        """The skips in micro-batches of another gang's size: the same samples (a gang of 3 hosts
        of 2-sequence micro-batches counts 6 samples to one, a gang of 4 hosts 8)."""
        return regeometry(self.skips, self.per_micro_batch, per_micro_batch)


def take_live_state(rank: int, source: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    progress: Progress, skips: Skips) -> tuple[Progress, list]:
    """The gang's newest live state, sent by rank `source` to every rank (one broadcast on the
    gang's process group): its progress and the source's loader skips; the other ranks load the
    model and optimizer in place."""
    import torch.distributed as dist

    started = time.monotonic()
    state = [None]
    if rank == source:
        state = [{"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                  "progress": (progress.step, progress.tokens_seen), "skips": list(skips)}]
    dist.broadcast_object_list(state, src=source)
    taken = state[0]
    if rank != source:
        model.load_state_dict(taken["model"])
        optimizer.load_state_dict(taken["optimizer"])
        optimizer.zero_grad(set_to_none=True)
        progress = Progress(taken["progress"][0], 0, taken["progress"][1])
    size = sum(t.numel() * t.element_size() for t in _tensors(taken))
    seconds = time.monotonic() - started
    log.info("state taken from a peer" if rank != source else "state sent to the gang", step=progress.step,
             source=source, bytes=size, seconds=round(seconds, 3),
             bytes_per_s=round(size / seconds) if seconds > 0 else None)
    return progress, [tuple(s) for s in taken["skips"]]


def check_same_teacher(before: str | None, now: str | None, step: int, allowed: list[str], where: str) -> None:
    """A distilled checkpoint resumes only with the teacher it was distilled from (identities; a
    gang's resume compares this with the rest of the spec)."""
    if now is None or before is None or before == now or "distill" in allowed:
        return
    raise ConfigError("distill.teacher", f"the checkpoint at step {step} was distilled from another teacher "
                      f"(identity {before}; {where} is {now}): name that teacher again, or list distill in "
                      "checkpoint.allow_spec_changes to go on with this one")


def check_same_data(before: str, now: str, data: DataConfig, step: int) -> None:
    """A resume on different data is an error, unless the job says data.allow_change."""
    if before == now:
        return
    if not data.allow_change:
        key = "data.mixture" if data.mixture else "data.dataset"
        raise ConfigError(key, f"the checkpoint at step {step} was trained on other data ({before}, now "
                          f"{now}); set data.allow_change: true to continue on the new data")
    log.warning("resuming on other data (data.allow_change)", saved=before, now=now)


def _tensors(tree) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_flatten

    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]
