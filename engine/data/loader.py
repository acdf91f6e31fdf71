"""Packed-token batches whose content is a pure function of (seed, step, micro-step, rank).

The samples come from a stream (engine.data.dataset: the built-in corpus or prepared
datasets, shuffled or blended) that maps the run's sample index g to a window of seq_len + 1
tokens, so the loader has no state to save: resuming at a step reproduces exactly the
batches an uninterrupted run would have seen. Micro-batch i of the run is global samples
i x world x micro_batch_size onwards, and each rank reads its slice of it: the sequence of
global batches depends on the global batch size only, not on how many ranks share it.

The number of micro-batches per step may grow on a step schedule (a batch-size ramp, see
`AccumSchedule`); micro-batch g of the run is then the micro-step of its step plus the
micro-batches of all earlier steps, counted in closed form from the ramp.

After a non-finite loss the supervisor rolls back and the batches of the bad step are
skipped (`skips`): the stream of micro-batches jumps over them, so every later step reads
the micro-batches that follow, still a pure function of (seed, skips, step, micro-step, rank).

When targets are left out of the loss (document masking, the loss masks of chat data),
micro-batches hold different numbers of targets; each micro-batch's loss is weighted
(`loss_weight`) by its share of the step's targets, counted over the whole global batch, which
every process can do alone: the counts too are a pure function of the step.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.backends.base import DataPosition
from engine.data.batch import Batch, kept
from engine.data.dataset import Samples
from engine.data.skips import Skips, merge_skips
from engine.errors import ConfigError
from engine.fitting import largest_divisor
from engine.spec.schema import TrainConfig


@dataclass(frozen=True)
class AccumSchedule:
    """Micro-batches per optimizer step: stages[i] = (until_step, accum) gives accum to the steps
    from the previous stage's until_step (0 for the first) up to until_step, exclusive; `final`
    to every step after the last stage."""

    final: int = 1
    stages: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        untils = [0] + [until for until, _ in self.stages]
        if any(b <= a for a, b in zip(untils, untils[1:])) or min([self.final, *(a for _, a in self.stages)]) < 1:
            raise ValueError(f"ramp stages must have ascending positive until_step and accum >= 1: {self.stages}")

    @classmethod
    def of(cls, train: TrainConfig) -> AccumSchedule:
        return cls(train.grad_accum_steps, tuple((s.until_step, s.grad_accum_steps) for s in train.batch_ramp))

    def times(self, factor: int) -> AccumSchedule:
        """factor x as many micro-batches in every stage (each factor x smaller)."""
        return AccumSchedule(self.final * factor, tuple((until, accum * factor) for until, accum in self.stages))

    def at(self, step: int) -> int:
        """Micro-batches in `step`."""
        for until, accum in self.stages:
            if step < until:
                return accum
        return self.final

    def before(self, step: int) -> int:
        """Micro-batches in steps 0 .. step - 1; O(stages), not O(step)."""
        total, begin = 0, 0
        for until, accum in self.stages:
            if step <= until:
                return total + (step - begin) * accum
            total, begin = total + (until - begin) * accum, until
        return total + (step - begin) * self.final


def batch_geometry(train: TrainConfig, micro_batch_size: int | str, world: int,
                   cap: int | None = None) -> tuple[int, AccumSchedule]:
    """Sequences per micro-batch per rank, and micro-batches per step, for `world` data-parallel ranks.

    With train.global_batch_size the global batch stays the same on any number of ranks (a job
    resumed on fewer hosts): each step still reads global samples [step x G, (step + 1) x G).
    `cap` is the largest micro-batch known to fit in memory (engine.fitting): a smaller micro-batch
    that divides the batch, with as many more of them per step, reads the same samples per step.
    """
    if train.global_batch_size is None:  # micro_batch_size is a number: auto needs a global batch
        if cap is None or cap >= micro_batch_size:
            return micro_batch_size, AccumSchedule.of(train)
        fits = largest_divisor(micro_batch_size, cap)
        return fits, AccumSchedule.of(train).times(micro_batch_size // fits)
    per_rank, rest = divmod(train.global_batch_size, world)
    if rest or not per_rank:
        raise ConfigError("train.global_batch_size", f"{train.global_batch_size} sequences do not divide evenly "
                          f"among {world} data-parallel ranks (hosts x devices)")
    most = per_rank if micro_batch_size == "auto" else min(micro_batch_size, per_rank)
    fits = largest_divisor(per_rank, most if cap is None else min(most, cap))
    return fits, AccumSchedule(per_rank // fits)


class PackedLoader:
    def __init__(self, samples: Samples, micro_batch_size: int, accum: AccumSchedule | int,
                 seed: int = 0, position: DataPosition = DataPosition(), skips: Iterable[Iterable[int]] = (),
                 identity: str = "", document_mask: bool = False, global_loss: bool = False,
                 offline_teacher: bool = False):
        """document_mask: batches carry segment ids, positions and ignored boundary targets.
        offline_teacher: batches carry the data's stored teacher top k (engine.distill.offline).
        global_loss: one program's loss covers every process's slice (SPMD), instead of each
        process's loss its own slice with the gradients averaged over processes (DDP, FSDP)."""
        self.samples, self.window = samples, samples.window
        self.n_windows = samples.n
        if self.n_windows < micro_batch_size:
            raise ConfigError("data.micro_batch_size", f"{micro_batch_size} sequences, but the data holds only "
                              f"{self.n_windows} windows of data.seq_len + 1 = {self.window} tokens")
        self.micro_batch_size = micro_batch_size
        self.accum = accum if isinstance(accum, AccumSchedule) else AccumSchedule(accum)
        self.seed, self.position, self.identity = seed, position, identity
        self.document_mask, self.global_loss, self.offline_teacher = document_mask, global_loss, offline_teacher
        self.skips = skips
        self._counted: tuple[tuple[int, ...], np.ndarray] | None = None  # the last step's target counts

    @property
    def skips(self) -> Skips:
        """Ranges (first, count) of global micro-batches the stream jumps over, sorted by first.

        Applied in that order, a range moves every index at or past `first` on by `count`
        (`index`). A range from `skip_range` removes exactly one step's micro-batches from the
        stream the earlier ranges left, even when recorded after ranges at higher indices (a
        second rollback to an older checkpoint) or when the step straddles an earlier skip.
        """
        return self._skips

    @skips.setter
    def skips(self, skips: Iterable[Iterable[int]]) -> None:
        self._skips = merge_skips(skips)

    def index(self, step: int, micro_step: int) -> int:
        """The global micro-batch index, in the unskipped stream, of (step, micro_step)."""
        i = self.accum.before(step) + micro_step
        for first, count in self._skips:
            if i >= first:
                i += count
        return i

    def skip_range(self, step: int) -> tuple[int, int]:
        """The skip range that drops the micro-batches of `step` (0-based) as this loader assigns them."""
        return self.index(step, 0), self.accum.at(step)

    def tokens_in_steps(self, start: int, stop: int) -> int:
        """Tokens this process feeds the model in steps start .. stop - 1."""
        return (self.accum.before(stop) - self.accum.before(start)) * self.micro_batch_size * (self.window - 1)

    def batch(self, step: int, micro_step: int) -> Batch:
        """This process's slice of the global batch: micro_batch_size sequences of seq_len."""
        if not 0 <= micro_step < self.accum.at(step):
            raise IndexError(f"step {step} has {self.accum.at(step)} micro-batches, not a micro-step {micro_step}")
        # A skipped micro-batch index is skipped on every rank: ranks share the global index.
        return self.rows(self.index(step, micro_step))

    def _samples(self, index: int, rank: int) -> np.ndarray:
        first = (index * self.position.world + rank) * self.micro_batch_size
        return np.arange(first, first + self.micro_batch_size)

    def rows(self, index: int) -> Batch:
        """This rank's slice of global micro-batch `index` of the stream."""
        samples = self._samples(index, self.position.rank)
        segments = self.samples.read("segments", samples) if self.document_mask else None
        masks = self.samples.read("masks", samples) if self.samples.masked else None
        teacher = ((self.samples.read("teacher_ids", samples), self.samples.read("teacher_logp", samples))
                   if self.offline_teacher else None)
        return Batch.of(self.samples.read("rows", samples), segments, masks, teacher)

    def _target_counts(self, step: int) -> np.ndarray:
        return self.target_counts(tuple(self.index(step, m) for m in range(self.accum.at(step))))

    def target_counts(self, indices: tuple[int, ...]) -> np.ndarray:
        """[micro-batches, ranks]: the targets trained on in each rank's slice of each global
        micro-batch of `indices`; from the document index (and loss masks) alone, no tokens read."""
        if self._counted is None or self._counted[0] != indices:
            world, full = self.position.world, self.micro_batch_size * (self.window - 1)
            counts = np.full((len(indices), world), full, dtype=np.int64)
            for (i, index), r in itertools.product(enumerate(indices), range(world)):
                samples = self._samples(index, r)
                if self.samples.masked:
                    segments = self.samples.read("segments", samples) if self.document_mask else None
                    counts[i, r] = np.count_nonzero(kept(segments, self.samples.read("masks", samples)))
                elif self.document_mask:
                    counts[i, r] -= self.samples.read("boundaries", samples).sum()
            self._counted = indices, counts
        return self._counted[1]

    def step_targets(self, step: int) -> int:
        """The targets trained on in the whole global batch of `step`."""
        return int(self._target_counts(step).sum())

    def loss_weight(self, step: int, micro_step: int) -> float:
        """What micro-batch `micro_step`'s mean loss is multiplied by, before the step divides
        by its micro-batch count as without masks, so that the step's loss is the sum over every
        target of the global batch divided by their number: one large batch's loss, whatever
        share of the targets each micro-batch and rank holds. 1.0 exactly when every micro-batch
        holds as many targets as every other (no masks)."""
        return self.weight(self._target_counts(step), micro_step)

    def weight(self, counts: np.ndarray, micro: int) -> float:
        """Micro-batch `micro`'s loss weight among target counts [micro-batches, ranks] (`loss_weight`)."""
        total = max(int(counts.sum()), 1)
        if self.global_loss:  # the loss's mean is over the whole micro-batch; nothing averages it
            return len(counts) * int(counts[micro].sum()) / total
        # The mean is over this rank's slice, and the ranks' gradients are averaged.
        return len(counts) * int(counts[micro, self.position.rank]) * self.position.world / total

    def state_dict(self) -> dict:
        # Position is a function of the step; the data's identity (seed included) and geometry
        # guard against resuming with a different data order. Skips are not here: they only grow during a job, and
        # checkpoints carry them in the manifest (data_skips), read before the state is loaded.
        return {"data": self.identity, "seed": self.seed, "window": self.window, "n_windows": self.n_windows,
                "micro_batch_size": self.micro_batch_size, "rank": self.position.rank, "world": self.position.world,
                "accum": {"final": self.accum.final, "stages": [list(s) for s in self.accum.stages]}}
