"""Fixed-length training windows over token stores, one source or a weighted mixture of several, and the
order in which global samples visit them (`Corpus`: what the loader needs from the data)."""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from titanlite.data.order import EpochOrder, MixtureOrder
from titanlite.data.sources import Source, parse_source
from titanlite.data.store import DEFAULT_SHARD_BYTES, TokenStore, describe, open_store
from titanlite.data.tokenizer import Tokenizer
from titanlite.errors import ConfigError


class PackedWindows(Dataset):
    """Window i is tokens[i*seq_len : (i+1)*seq_len + 1] as int64.

    Consecutive windows share one boundary token, so inputs (window[:-1]) and labels (window[1:])
    together predict every token of the corpus after the first exactly once per epoch.
    """

    def __init__(self, tokens: np.ndarray | TokenStore, seq_len: int) -> None:
        if seq_len < 1:
            raise ConfigError(f"training.seq_len={seq_len} must be at least 1")
        self.tokens = tokens if isinstance(tokens, TokenStore) else TokenStore([tokens])
        self.seq_len = seq_len
        self.num_windows = (len(self.tokens) - 1) // seq_len
        if self.num_windows < 1:
            where = f"{self.tokens.label} has" if self.tokens.label else "the corpus has"
            raise ConfigError(
                f"{where} {len(self.tokens)} tokens, too few for training.seq_len={seq_len}; "
                "use a larger corpus or a smaller training.seq_len"
            )

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.num_windows:
            raise IndexError(f"window {index} out of range for {self.num_windows} windows")
        start = index * self.seq_len
        # np.array copies out of the read-only memmap, so the tensor owns writable memory.
        return torch.from_numpy(np.array(self.tokens.read(start, start + self.seq_len + 1), dtype=np.int64))


class MixedWindows(Dataset):
    """The windows of several sources, numbered one source after another."""

    def __init__(self, parts: list[PackedWindows]) -> None:
        self.parts = parts
        self.offsets = np.cumsum([0, *[len(p) for p in parts]]).tolist()

    def __len__(self) -> int:
        return self.offsets[-1]

    def __getitem__(self, index: int) -> torch.Tensor:
        part = bisect.bisect_right(self.offsets, index) - 1
        return self.parts[part][index - self.offsets[part]]


@dataclass
class Corpus:
    """The windows of a run and how global samples map onto them (`order.windows(samples)`)."""

    windows: Dataset
    order: EpochOrder | MixtureOrder
    stores: list[TokenStore]
    weights: list[float] | None = None

    def describe(self, num_samples: int) -> list[str]:
        """One line per source; for a mixture, each source's share of the run's first `num_samples`."""
        if self.weights is None:
            return [describe(self.stores[0])]
        shares = self.order.shares(num_samples)
        lines = []
        for store, part, weight, count in zip(self.stores, self.windows.parts, self.weights, shares):
            lines.append(
                f"{describe(store)}; weight {weight:g}: {count / num_samples:.1%} of the run's {num_samples:,} "
                f"samples ({count / len(part):.3g} epochs of its {len(part):,} windows)"
            )
        return lines


def parse_mixture(entries: list[str]) -> list[tuple[Source, float]]:
    """training.dataset_mixture entries "SOURCE:WEIGHT", SOURCE being a path, 'stdlib' or 'hub:NAME'."""
    mixture = []
    for entry in entries:
        location, _, weight = entry.rpartition(":")
        try:
            value = float(weight)
        except ValueError:
            value = -1.0
        if not location or not value > 0:
            raise ConfigError(
                f"training.dataset_mixture entry '{entry}' is not SOURCE:WEIGHT with a positive weight "
                "(e.g. \"data/web:0.7\", \"stdlib:0.3\")"
            )
        mixture.append((parse_source(location, "training.dataset_mixture"), value))
    return mixture


def configured_sources(dataset: str, dataset_path: str, mixture: list[str]) -> list[tuple[Source, float]]:
    """The run's sources with their weights, from training.dataset / dataset_path or dataset_mixture."""
    if mixture:
        if dataset_path:
            raise ConfigError("set either training.dataset_path or training.dataset_mixture, not both")
        return parse_mixture(mixture)
    if dataset != "local" and dataset_path:
        raise ConfigError("training.dataset_path is only used with training.dataset = 'local'; unset it")
    if dataset == "stdlib":
        return [(Source("stdlib", "", "training.dataset"), 1.0)]
    if dataset == "local":
        return [(Source("local", dataset_path, "training.dataset_path"), 1.0)]
    return [(Source("hub", dataset, "training.dataset"), 1.0)]


def build_corpus(sources: list[tuple[Source, float]], tokenizer: Tokenizer, cache_dir: str | Path, seq_len: int,
                 seed: int, shuffle: bool = True, *, verify: str = "stat", workers: int = 0,
                 shard_bytes: int = DEFAULT_SHARD_BYTES, say: Callable[[str], None] | None = None) -> Corpus:
    """Open (preparing where needed) each source's store and lay the windows out in sample order."""
    stores = [open_store(source, tokenizer, cache_dir, verify=verify, workers=workers, shard_bytes=shard_bytes, say=say)
              for source, _ in sources]
    parts = [PackedWindows(store, seq_len) for store in stores]
    if len(sources) == 1:
        return Corpus(parts[0], EpochOrder(len(parts[0]), seed, shuffle), stores)
    weights = [weight for _, weight in sources]
    order = MixtureOrder([len(p) for p in parts], weights, seed, shuffle)
    return Corpus(MixedWindows(parts), order, stores, weights)
