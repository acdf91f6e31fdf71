"""The prefetcher hands out exactly the loader's batches, whatever order they are asked for in."""

import threading

import numpy as np
import torch

from engine.data.loader import AccumSchedule
from engine.data.prefetch import Prefetcher
from testkit.recorders import array_loader


def test_batches_are_the_loaders_in_order_after_jumps_and_when_skips_change():
    loader = array_loader(np.arange(5000, dtype=np.int32) % 251, seq_len=16, micro_batch_size=2)
    loader.accum = AccumSchedule(3, ((2, 1),))  # a ramp: one micro-batch in steps 0-1, three after
    threads = []

    def host_ready(batch):
        threads.append(threading.current_thread().name)
        return batch.clone()

    batches = Prefetcher(loader, host_ready)
    try:
        order = [(0, 0), (1, 0), (2, 0), (2, 1), (2, 2), (3, 0),  # in order, across the ramp
                 (7, 1), (7, 2),                                  # a jump (a resume mid-step)
                 (2, 0)]                                          # and back (a rollback)
        for step, micro in order:
            assert batches.batch(step, micro) == loader.batch(step, micro), (step, micro)
        loader.skips = [(loader.index(8, 0), 3)]  # a skip recorded while (8, 0) was being read
        assert batches.batch(2, 1) == loader.batch(2, 1)
        assert batches.batch(2, 2) == loader.batch(2, 2)
        assert batches.batch(8, 0) == loader.batch(8, 0)
    finally:
        batches.close()
    # The batches asked for in order came from the prefetching thread, not the caller's.
    assert sum(name.startswith("tpud-prefetch") for name in threads) >= 6
