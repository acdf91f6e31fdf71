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
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.backends.base import DataPosition
from engine.data.dataset import Samples
from engine.errors import ConfigError
from engine.spec.schema import TrainConfig
from engine.layout import atomic_write


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


def batch_geometry(train: TrainConfig, micro_batch_size: int, world: int) -> tuple[int, AccumSchedule]:
    """Sequences per micro-batch per rank, and micro-batches per step, for `world` data-parallel ranks.

    With train.global_batch_size the global batch stays the same on any number of ranks (a job
    resumed on fewer hosts): each step still reads global samples [step x G, (step + 1) x G).
    """
    if train.global_batch_size is None:
        return micro_batch_size, AccumSchedule.of(train)
    per_rank, rest = divmod(train.global_batch_size, world)
    if rest or not per_rank:
        raise ConfigError("train.global_batch_size", f"{train.global_batch_size} sequences do not divide evenly "
                          f"among {world} data-parallel ranks (hosts x devices)")
    fits = max(d for d in range(1, min(micro_batch_size, per_rank) + 1) if per_rank % d == 0)
    return fits, AccumSchedule(per_rank // fits)


Skips = tuple[tuple[int, int], ...]


def merge_skips(*lists: Iterable[Iterable[int]]) -> Skips:
    """The union of skip lists as the loader wants it: sorted (first, count) pairs, no duplicates."""
    merged = {(int(first), int(count)) for skips in lists for first, count in skips}
    if any(first < 0 or count < 1 for first, count in merged):
        raise ValueError(f"skip ranges must be (first >= 0, count >= 1): {sorted(merged)}")
    return tuple(sorted(merged))


def read_skips(path: Path) -> Skips:
    """The skip list persisted in a job's state directory (data_skips.json); none if absent."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return ()
    return merge_skips(data["skips"])


def write_skips(path: Path, skips: Skips) -> None:
    """Durably replace the skip list: {"format": 1, "skips": [[first, count], ...]}."""
    atomic_write(path, json.dumps({"format": 1, "skips": [list(s) for s in skips]}))


class PackedLoader:
    def __init__(self, samples: Samples, micro_batch_size: int, accum: AccumSchedule | int,
                 seed: int = 0, position: DataPosition = DataPosition(), skips: Iterable[Iterable[int]] = (),
                 identity: str = ""):
        self.samples, self.window = samples, samples.window
        self.n_windows = samples.n
        if self.n_windows < micro_batch_size:
            raise ConfigError("data.micro_batch_size", f"{micro_batch_size} sequences, but the data holds only "
                              f"{self.n_windows} windows of data.seq_len + 1 = {self.window} tokens")
        self.micro_batch_size = micro_batch_size
        self.accum = accum if isinstance(accum, AccumSchedule) else AccumSchedule(accum)
        self.seed, self.position, self.identity = seed, position, identity
        self.skips = skips

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

    def batch(self, step: int, micro_step: int) -> torch.Tensor:
        """int64 [micro_batch_size, seq_len + 1] for this process's slice of the global batch."""
        if not 0 <= micro_step < self.accum.at(step):
            raise IndexError(f"step {step} has {self.accum.at(step)} micro-batches, not a micro-step {micro_step}")
        # A skipped micro-batch index is skipped on every rank: ranks share the global index.
        return self.rows(self.index(step, micro_step))

    def rows(self, index: int) -> torch.Tensor:
        """This rank's slice of global micro-batch `index` of the stream."""
        pos = self.position
        first = (index * pos.world + pos.rank) * self.micro_batch_size
        rows = self.samples.rows(np.arange(first, first + self.micro_batch_size))
        return torch.from_numpy(rows.astype(np.int64))

    def state_dict(self) -> dict:
        # Position is a function of the step; the data's identity (seed included) and geometry
        # guard against resuming with a different data order. Skips are not here: they only grow during a job, and
        # checkpoints carry them in the manifest (data_skips), read before the state is loaded.
        return {"data": self.identity, "seed": self.seed, "window": self.window, "n_windows": self.n_windows,
                "micro_batch_size": self.micro_batch_size, "rank": self.position.rank, "world": self.position.world,
                "accum": {"final": self.accum.final, "stages": [list(s) for s in self.accum.stages]}}
