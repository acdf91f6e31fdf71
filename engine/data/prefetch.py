"""The next micro-batch read (and pinned, on CUDA) on a thread while the device runs this one.

Batches are a pure function of their global micro-batch index (engine.data.loader), so the
prefetched one is keyed by that index: a request for any other (a resume, skips changed, an
evaluation's own loader in between) is read in the caller's thread and nothing goes stale.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import torch

from engine.data.batch import Batch
from engine.data.loader import PackedLoader
from engine.side_threads import side_thread


class Prefetcher:
    def __init__(self, loader: PackedLoader, host_ready: Callable[[torch.Tensor], torch.Tensor]):
        """host_ready: what the backend wants done to a batch before it is sent (pinning)."""
        self.loader, self.host_ready = loader, host_ready
        self._pool = side_thread("tpud-prefetch")
        self._next: tuple[int, Future] | None = None

    def batch(self, step: int, micro_step: int) -> Batch:
        """loader.batch(step, micro_step), made ready for the device; starts reading the one after."""
        index = self.loader.index(step, micro_step)
        after = (step, micro_step + 1) if micro_step + 1 < self.loader.accum.at(step) else (step + 1, 0)
        if self._next is not None and self._next[0] == index:
            batch = self._next[1].result()
        else:
            batch = self.loader.batch(step, micro_step).map(self.host_ready)
        following = self.loader.index(*after)
        self._next = (following, self._pool.submit(self._read, following))
        return batch

    def _read(self, index: int) -> Batch:
        return self.loader.rows(index).map(self.host_ready)

    def close(self) -> None:
        self._next = None
        self._pool.shutdown(wait=False, cancel_futures=True)
