"""Orders computed per index, never materialised: shuffles, the validation split, mixtures. Torch-free.

`Permutation(n, key)` maps i to a position in [0, n) bijectively with a Feistel network
over the smallest even number of bits that covers n, cycle-walking the values that fall
outside [0, n): O(1) memory, O(1) expected time per index (the domain is at most 4n), so
the training order of a 10^12-token dataset costs nothing to set up and nothing to resume.

`Blend(weights, key)` interleaves several sources in fixed proportions: each block of
`BLOCK` samples holds round(w x BLOCK) slots of each source (largest remainders), in a
seeded order; sample g is slot g mod BLOCK of block g div BLOCK, and its index within its
source counts that source's slots in earlier blocks and slots. So proportions hold to
within one slot per block, at every prefix of the run, and any sample is found in O(1).
"""

from __future__ import annotations

import numpy as np

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)
ROUNDS = 6
BLOCK = 1000


def mix(values: np.ndarray, key: int) -> np.ndarray:
    """splitmix64's finaliser of values ^ key: a well-spread 64-bit hash, vectorised."""
    with np.errstate(over="ignore"):
        z = (np.asarray(values, dtype=np.uint64) ^ np.uint64(key & 0xFFFFFFFFFFFFFFFF)) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def key_of(*parts: int) -> int:
    """One 64-bit key from several integers (seed, epoch, ...)."""
    key = 0x243F6A8885A308D3
    for part in parts:
        key = int(mix(np.uint64(part & 0xFFFFFFFFFFFFFFFF), key))
    return key


def unit(values: np.ndarray, key: int) -> np.ndarray:
    """A deterministic uniform number in [0, 1) for each value."""
    return (mix(values, key) >> np.uint64(11)).astype(np.float64) / float(1 << 53)


class Permutation:
    def __init__(self, n: int, key: int):
        if n < 1:
            raise ValueError("a permutation needs at least one element")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = (bits + 1) // 2
        self.mask = np.uint64((1 << self.half) - 1)
        self.keys = [key_of(key, r) for r in range(ROUNDS)]

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(self.half), x & self.mask
        for k in self.keys:
            left, right = right, left ^ (mix(right, k) & self.mask)
        return (left << np.uint64(self.half)) | right

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        x = self._encrypt(np.asarray(indices, dtype=np.uint64))
        outside = x >= np.uint64(self.n)
        while outside.any():  # cycle-walk: a bijection of [0, 4^half) restricted to [0, n)
            x[outside] = self._encrypt(x[outside])
            outside = x >= np.uint64(self.n)
        return x.astype(np.int64)


class Blend:
    def __init__(self, weights: list[float], key: int):
        total = sum(weights)
        quotas = [w / total * BLOCK for w in weights]
        counts = [int(q) for q in quotas]
        for i in sorted(range(len(weights)), key=lambda i: counts[i] - quotas[i])[: BLOCK - sum(counts)]:
            counts[i] += 1
        slots = np.repeat(np.arange(len(weights)), counts)
        self.source = slots[np.random.default_rng(key % (1 << 63)).permutation(BLOCK)]
        # rank[s]: how many earlier slots of the block belong to slot s's source
        self.rank = np.zeros(BLOCK, dtype=np.int64)
        seen = np.zeros(len(weights), dtype=np.int64)
        for s, source in enumerate(self.source):
            self.rank[s], seen[source] = seen[source], seen[source] + 1
        self.counts = np.array(counts, dtype=np.int64)

    def __call__(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, index within that source) of each global sample."""
        block, slot = np.divmod(np.asarray(samples, dtype=np.int64), BLOCK)
        source = self.source[slot]
        return source, block * self.counts[source] + self.rank[slot]
