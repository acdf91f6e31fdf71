"""Skipped micro-batches: ranges (first, count) of a run's global micro-batches, in the unskipped
stream, that its loader jumps over (engine.data.loader, engine.health.ledger). Torch-free."""

from __future__ import annotations

from collections.abc import Iterable

Skips = tuple[tuple[int, int], ...]


def merge_skips(*lists: Iterable[Iterable[int]]) -> Skips:
    """The union of skip lists as the loader wants it: sorted (first, count) pairs, no duplicates."""
    merged = {(int(first), int(count)) for skips in lists for first, count in skips}
    if any(first < 0 or count < 1 for first, count in merged):
        raise ValueError(f"skip ranges must be (first >= 0, count >= 1): {sorted(merged)}")
    return tuple(sorted(merged))


def sample_ranges_to_micro_batches(ranges: Iterable[tuple[int, int]], per_micro_batch: int) -> Skips:
    """The micro-batches (first, count) holding the samples of `ranges`: every one with a listed sample."""
    return merge_skips((first // per_micro_batch, (first + count - 1) // per_micro_batch - first // per_micro_batch + 1)
                       for first, count in ranges)


def regeometry(skips: Iterable[tuple[int, int]], before: int, now: int) -> Skips:
    """Ranges of micro-batches of `before` samples as micro-batches of `now` samples: the same samples
    (and, when `now` does not divide them, the rest of the micro-batches that hold them)."""
    if before == now:
        return merge_skips(skips)
    return sample_ranges_to_micro_batches(((first * before, count * before) for first, count in skips), now)
