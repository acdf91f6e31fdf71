"""Packed-token batches whose content is a pure function of (seed, step, micro-step, rank).

The token stream is cut into non-overlapping windows of seq_len + 1 tokens; each epoch
visits every window once, in an order drawn from (seed, epoch). Sample g of the run is
window perm[epoch][g mod n] with epoch = g div n, so the loader has no state to save:
resuming at a step reproduces exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.backends.base import DataPosition


class PackedLoader:
    def __init__(self, tokens: np.ndarray, seq_len: int, micro_batch_size: int, grad_accum_steps: int,
                 seed: int, position: DataPosition = DataPosition()):
        self.window = seq_len + 1  # inputs and targets overlap by one shifted token
        self.n_windows = len(tokens) // self.window
        if self.n_windows < micro_batch_size:
            raise ValueError(f"corpus of {len(tokens)} tokens holds only {self.n_windows} windows of {self.window}")
        self.tokens = tokens[: self.n_windows * self.window].reshape(self.n_windows, self.window)
        self.micro_batch_size, self.grad_accum_steps = micro_batch_size, grad_accum_steps
        self.seed, self.position = seed, position
        self._perm_epoch, self._perm = -1, None

    @property
    def tokens_per_step(self) -> int:
        """Tokens this process feeds the model per optimizer step."""
        return self.micro_batch_size * self.grad_accum_steps * (self.window - 1)

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
            self._perm_epoch = epoch
        return self._perm

    def batch(self, step: int, micro_step: int) -> torch.Tensor:
        """int64 [micro_batch_size, seq_len + 1] for this process's slice of the global batch."""
        pos = self.position
        first = ((step * self.grad_accum_steps + micro_step) * pos.world + pos.rank) * self.micro_batch_size
        rows = []
        for g in range(first, first + self.micro_batch_size):
            epoch, i = divmod(g, self.n_windows)
            rows.append(self.tokens[self._order(epoch)[i]])
        return torch.from_numpy(np.stack(rows).astype(np.int64))

    def state_dict(self) -> dict:
        # Position is a function of the step; the seed and geometry guard against resuming
        # with a different data order.
        return {"seed": self.seed, "window": self.window, "n_windows": self.n_windows,
                "micro_batch_size": self.micro_batch_size, "rank": self.position.rank, "world": self.position.world}
