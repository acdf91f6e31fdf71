"""Packed-token batches whose content is a pure function of (seed, step, micro-step, rank).

The token stream is cut into non-overlapping windows of seq_len + 1 tokens; each epoch
visits every window once, in an order drawn from (seed, epoch). Sample g of the run is
window perm[epoch][g mod n] with epoch = g div n, so the loader has no state to save:
resuming at a step reproduces exactly the batches an uninterrupted run would have seen.

The number of micro-batches per step may grow on a step schedule (a batch-size ramp, see
`AccumSchedule`); micro-batch g of the run is then the micro-step of its step plus the
micro-batches of all earlier steps, counted in closed form from the ramp.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.backends.base import DataPosition
from engine.config import TrainConfig


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


class PackedLoader:
    def __init__(self, tokens: np.ndarray, seq_len: int, micro_batch_size: int, accum: AccumSchedule | int,
                 seed: int, position: DataPosition = DataPosition()):
        self.window = seq_len + 1  # inputs and targets overlap by one shifted token
        self.n_windows = len(tokens) // self.window
        if self.n_windows < micro_batch_size:
            raise ValueError(f"corpus of {len(tokens)} tokens holds only {self.n_windows} windows of {self.window}")
        self.tokens = tokens[: self.n_windows * self.window].reshape(self.n_windows, self.window)
        self.micro_batch_size = micro_batch_size
        self.accum = accum if isinstance(accum, AccumSchedule) else AccumSchedule(accum)
        self.seed, self.position = seed, position
        self._perm_epoch, self._perm = -1, None

    def tokens_in_steps(self, start: int, stop: int) -> int:
        """Tokens this process feeds the model in steps start .. stop - 1."""
        return (self.accum.before(stop) - self.accum.before(start)) * self.micro_batch_size * (self.window - 1)

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
            self._perm_epoch = epoch
        return self._perm

    def batch(self, step: int, micro_step: int) -> torch.Tensor:
        """int64 [micro_batch_size, seq_len + 1] for this process's slice of the global batch."""
        pos = self.position
        if not 0 <= micro_step < self.accum.at(step):
            raise IndexError(f"step {step} has {self.accum.at(step)} micro-batches, not a micro-step {micro_step}")
        first = ((self.accum.before(step) + micro_step) * pos.world + pos.rank) * self.micro_batch_size
        rows = []
        for g in range(first, first + self.micro_batch_size):
            epoch, i = divmod(g, self.n_windows)
            rows.append(self.tokens[self._order(epoch)[i]])
        return torch.from_numpy(np.stack(rows).astype(np.int64))

    def state_dict(self) -> dict:
        # Position is a function of the step; the seed and geometry guard against resuming
        # with a different data order.
        return {"seed": self.seed, "window": self.window, "n_windows": self.n_windows,
                "micro_batch_size": self.micro_batch_size, "rank": self.position.rank, "world": self.position.world,
                "accum": {"final": self.accum.final, "stages": [list(s) for s in self.accum.stages]}}
