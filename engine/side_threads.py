"""The threads beside the training loop (the checkpoint writer, the memory tier's, the prefetcher,
XLA's metric reader) run torch single-threaded.

A torch op big enough to go parallel, run on a thread of its own, starts a second OpenMP team
beside the loop's, and on a CPU host the two then share the cores for the rest of the run: the
tiny job's steps went from 37 to 60-70 ms after the first disk checkpoint written from the memory
tier (DCP copies the slot's views on the writer thread) and stayed there. These threads copy,
checksum and wait on I/O; one core serves them.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch


def side_thread(name: str) -> ThreadPoolExecutor:
    """One worker thread, named `name`, whose torch ops never start an OpenMP team of their own."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=torch.set_num_threads,
                              initargs=(1,))
