"""Which window each global sample reads: a seeded shuffle per epoch, and weighted mixtures of sources.

Both are pure functions of the sample index (no per-epoch array that grows with the corpus), so the
loader's whole state stays one number and any layout can resume from it.
"""

from __future__ import annotations

import math

import numpy as np

from titanlite.base.errors import ConfigError

MASK64 = (1 << 64) - 1
FEISTEL_ROUNDS = 6
# A mixture interleaves its sources in blocks of this many samples, each source taking its weight's
# share of every block (rounded by largest remainder).
MIXTURE_BLOCK = 4096


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a fast, well-spread 64-bit hash of uint64 values."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _key(*parts: int) -> int:
    """One 64-bit key from integers (seed, epoch, ...), each mixed in turn."""
    key = 0x9E3779B97F4A7C15
    for part in parts:
        key = int(_mix64(np.array([(key ^ (part & MASK64)) & MASK64], dtype=np.uint64))[0])
    return key


class SeededPermutation:
    """A bijection of [0, n) chosen by `key`: a balanced Feistel network on the smallest even number of
    bits that covers n, with cycle-walking for values that land outside [0, n). O(1) memory and start-up
    whatever n is; applied to whole arrays of positions at once."""

    def __init__(self, n: int, key: int) -> None:
        if n < 1:
            raise ValueError(f"n={n} must be at least 1")
        self.n = n
        self.half_bits = max(1, math.ceil(math.log2(n)) + 1) // 2 if n > 1 else 1
        self.half_mask = np.uint64((1 << self.half_bits) - 1)
        self.round_keys = [np.uint64(_key(key, r)) for r in range(FEISTEL_ROUNDS)]

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        x = np.asarray(positions, dtype=np.uint64)
        out = self._encrypt(x)
        outside = out >= self.n
        while outside.any():  # cycle-walking: at most a few rounds, as the domain is < 4n
            out[outside] = self._encrypt(out[outside])
            outside = out >= self.n
        return out.astype(np.int64)

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        bits = np.uint64(self.half_bits)
        left, right = x >> bits, x & self.half_mask
        for round_key in self.round_keys:
            left, right = right, left ^ (_mix64(right ^ round_key) & self.half_mask)
        return (left << bits) | right


class EpochOrder:
    """Global sample k reads window perm_e(k mod W) of epoch e = k // W: every window once per epoch, in
    an order seeded by (seed, epoch); window k mod W when not shuffled."""

    def __init__(self, num_windows: int, seed: int, shuffle: bool = True) -> None:
        if num_windows < 1:
            raise ValueError(f"num_windows={num_windows} must be at least 1")
        self.num_windows, self.seed, self.shuffle = num_windows, seed, shuffle
        self._epoch = -1
        self._perm: SeededPermutation | None = None

    def windows(self, samples: np.ndarray) -> np.ndarray:
        samples = np.asarray(samples, dtype=np.int64)
        epochs, positions = np.divmod(samples, self.num_windows)
        if not self.shuffle:
            return positions
        out = np.empty_like(positions)
        for epoch in np.unique(epochs):
            chosen = epochs == epoch
            out[chosen] = self._permutation(int(epoch))(positions[chosen])
        return out

    def _permutation(self, epoch: int) -> SeededPermutation:
        if epoch != self._epoch or self._perm is None:
            self._epoch, self._perm = epoch, SeededPermutation(self.num_windows, _key(self.seed, epoch))
        return self._perm


def mixture_counts(weights: list[float], block: int = MIXTURE_BLOCK) -> list[int]:
    """Samples per block for each source: weight shares of `block`, rounded by largest remainder."""
    total = sum(weights)
    exact = [w / total * block for w in weights]
    counts = [math.floor(e) for e in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in by_remainder[: block - sum(counts)]:
        counts[i] += 1
    return counts


def interleave(counts: list[int]) -> np.ndarray:
    """The source of each slot of a block: slot j goes to the source furthest behind its share of the
    first j + 1 slots (Megatron's blending rule), so every prefix of a block, and so every global batch,
    holds each source's share to within one sample."""
    block = sum(counts)
    wanted, assigned = np.array(counts, dtype=np.float64), np.zeros(len(counts))
    pattern = np.empty(block, dtype=np.int64)
    for j in range(block):
        s = int(np.argmax(wanted * (j + 1) / block - assigned))
        pattern[j] = s
        assigned[s] += 1
    return pattern


class MixtureOrder:
    """Global sample k of a weighted mixture: slot k mod B of every block of B samples belongs to the same
    source (`interleave`), each source taking its weight's share of the block; a source's n-th sample
    reads that source's window by its own seeded EpochOrder (small sources repeat, large ones are cut
    short: weights, not sizes, decide).

    Windows are numbered across sources: source s's window w is offsets[s] + w."""

    def __init__(
        self, sizes: list[int], weights: list[float], seed: int, shuffle: bool = True, block: int = MIXTURE_BLOCK
    ) -> None:
        self.counts = mixture_counts(weights, block)
        for weight, count in zip(weights, self.counts):
            if count == 0:
                raise ConfigError(
                    f"a mixture weight of {weight} is below 1/{block} of the total; raise it or drop the source"
                )
        self.block = block
        self.offsets = np.cumsum([0, *sizes[:-1]]).astype(np.int64)
        self.sources = [EpochOrder(size, _key(seed, 1 << 40, s), shuffle) for s, size in enumerate(sizes)]
        self.pattern = interleave(self.counts)
        # ordinal[j]: how many earlier slots of the block belong to slot j's source.
        self.ordinal = np.empty(block, dtype=np.int64)
        for s in range(len(self.counts)):
            slots = np.flatnonzero(self.pattern == s)
            self.ordinal[slots] = np.arange(len(slots))

    @property
    def num_windows(self) -> int:
        return int(self.offsets[-1]) + self.sources[-1].num_windows

    def windows(self, samples: np.ndarray) -> np.ndarray:
        blocks, slots = np.divmod(np.asarray(samples, dtype=np.int64), self.block)
        source = self.pattern[slots]
        out = np.empty_like(blocks)
        for s in np.unique(source):
            mine = source == s
            nth = blocks[mine] * self.counts[s] + self.ordinal[slots[mine]]
            out[mine] = self.sources[s].windows(nth) + self.offsets[s]
        return out

    def shares(self, num_samples: int) -> list[int]:
        """How many of the first `num_samples` samples each source provides."""
        full, rest = divmod(num_samples, self.block)
        partial = np.bincount(self.pattern[:rest], minlength=len(self.counts))
        return [full * c + int(p) for c, p in zip(self.counts, partial)]
