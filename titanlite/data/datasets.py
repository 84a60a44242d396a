"""Fixed-length training windows over token stores, one source or a weighted mixture of several, and the
order in which global samples visit them (`Corpus`: what the loader needs from the data)."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

from titanlite.base.errors import ConfigError
from titanlite.data.order import EpochOrder, MixtureOrder
from titanlite.data.sources import Source, parse_source
from titanlite.data.store import StoreOptions, TokenStore, describe
from titanlite.data.tokenizer import Tokenizer


class PackedWindows(Dataset):
    """Window i is tokens[start + i*seq_len : start + (i+1)*seq_len + 1] as int64, within [start, stop).

    Consecutive windows share one boundary token, so inputs (window[:-1]) and labels (window[1:])
    together predict every token of the range after the first exactly once per epoch.
    """

    def __init__(
        self,
        tokens: np.ndarray | TokenStore,
        seq_len: int,
        start: int = 0,
        stop: int | None = None,
        what: str = "training.seq_len",
    ) -> None:
        if seq_len < 1:
            raise ConfigError(f"{what}={seq_len} must be at least 1")
        self.tokens = tokens if isinstance(tokens, TokenStore) else TokenStore([tokens])
        self.seq_len, self.start = seq_len, start
        self.stop = len(self.tokens) if stop is None else stop
        self.num_windows = max(self.stop - start - 1, 0) // seq_len
        if self.num_windows < 1:
            where = f"{self.tokens.label} has" if self.tokens.label else "the corpus has"
            raise ConfigError(
                f"{where} {self.stop - start} tokens, too few for {what}={seq_len}; "
                "use a larger corpus or a smaller seq_len"
            )

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.num_windows:
            raise IndexError(f"window {index} out of range for {self.num_windows} windows")
        start = self.start + index * self.seq_len
        # np.array copies out of the read-only memmap, so the tensor owns writable memory.
        return torch.from_numpy(np.array(self.tokens.read(start, start + self.seq_len + 1), dtype=np.int64))


class MixedWindows(Dataset):
    """The windows of several sources, numbered one source after another; `names`, where given, name each part (the
    validation sets, each logged as val_loss/<name>)."""

    def __init__(self, parts: list[PackedWindows], names: list[str] | None = None) -> None:
        self.parts, self.names = parts, names
        self.offsets = np.cumsum([0, *[len(p) for p in parts]]).tolist()

    def __len__(self) -> int:
        return self.offsets[-1]

    def __getitem__(self, index: int) -> torch.Tensor:
        part = bisect.bisect_right(self.offsets, index) - 1
        return self.parts[part][index - self.offsets[part]]


@dataclass
class Corpus:
    """The windows of a run and how global samples map onto them (`order.windows(samples)`).

    `split` is where each store's held-out tail begins (its length when nothing is held out): training
    windows lie before it, validation windows (validation_windows) from it on."""

    windows: Dataset
    order: EpochOrder | MixtureOrder
    stores: list[TokenStore]
    weights: list[float] | None = None
    split: list[int] | None = None

    def describe(self, num_samples: int) -> list[str]:
        """One line per source; for a mixture, each source's share of the run's first `num_samples`."""
        held = [""] * len(self.stores)
        if self.split is not None:
            held = [
                f"; last {len(s) - at:,} tokens held out for validation" if at < len(s) else ""
                for s, at in zip(self.stores, self.split)
            ]
        if self.weights is None:
            return [describe(self.stores[0]) + held[0]]
        assert isinstance(self.order, MixtureOrder) and isinstance(self.windows, MixedWindows)  # weights: a mixture
        shares = self.order.shares(num_samples)
        lines = []
        for store, part, weight, count, h in zip(self.stores, self.windows.parts, self.weights, shares, held):
            lines.append(
                f"{describe(store)}{h}; weight {weight:g}: {count / num_samples:.1%} of the run's {num_samples:,} "
                f"samples ({count / len(part):.3g} epochs of its {len(part):,} windows)"
            )
        return lines


def split_point(store: TokenStore, eot_id: int, fraction: float, search: int = 2**20) -> int:
    """Where the held-out tail of `store` begins: `fraction` of its tokens from the end, moved to the nearest
    end-of-text within half that share (forward first, then back; at most `search` tokens), so documents
    are not cut where one is near; with none near (a long last document), inside that document, never
    holding out a sliver. At an end-of-text, the tail's first target is the first token of a document. The
    point depends on the tokens alone, never on the layout or the seed."""
    n = len(store)
    if fraction <= 0 or n == 0:
        return n
    held = max(1, round(fraction * n))
    nominal, reach = n - held, min(search, held // 2)
    ahead = np.flatnonzero(np.asarray(store.read(nominal, min(n, nominal + reach + 1))) == eot_id)
    if len(ahead):
        return nominal + int(ahead[0])
    first = max(0, nominal - reach)
    behind: np.ndarray | list[int] = (
        np.flatnonzero(np.asarray(store.read(first, nominal)) == eot_id) if nominal > first else []
    )
    return first + int(behind[-1]) if len(behind) else nominal


def validation_windows(
    stores: list[TokenStore], starts: list[int], seq_len: int, names: list[str] | None = None
) -> Dataset:
    """Windows over each store's tokens from `starts` on (a held-out tail, or 0 for a whole validation
    corpus), one source after another; every window in corpus order, the same on any layout. `names`: each store's
    validation set's name, where there are several."""
    if not stores:
        raise ConfigError("validation has no data: set validation.split_fraction > 0 or validation.dataset_path")
    parts = []
    for store, start in zip(stores, starts):
        if (len(store) - start - 1) // seq_len < 1:
            raise ConfigError(
                f"validation: {store.label or 'the corpus'} holds out {len(store) - start:,} tokens, too few for "
                f"one window of validation.seq_len={seq_len}; raise validation.split_fraction, lower "
                "validation.seq_len, or name a separate corpus with validation.dataset_path"
            )
        parts.append(PackedWindows(store, seq_len, start=start, what="validation.seq_len"))
    return parts[0] if len(parts) == 1 else MixedWindows(parts, names)


def set_names(sources: list[Source]) -> list[str]:
    """A short name for each validation source, as val_loss/<name> logs it: its file or folder name without
    extensions ('web' for data/web.jsonl.zst), 'stdlib', or a hub dataset's last part; a name taken twice gets the
    source's number after it (web_2)."""
    names = []
    for source in sources:
        if source.kind == "stdlib":
            name = "stdlib"
        else:
            name = source.location.rstrip("/").rsplit("/", 1)[-1].split("*")[0] or source.kind
            name = name.split(".")[0] or name
        names.append(name)
    return [f"{n}_{i + 1}" if names.count(n) > 1 else n for i, n in enumerate(names)]


def parse_mixture(entries: list[str], **options) -> list[tuple[Source, float]]:
    """training.dataset_mixture entries "SOURCE:WEIGHT", SOURCE being a path, 'stdlib' or 'hub:NAME'."""
    mixture = []
    for entry in entries:
        location, _, weight = entry.rpartition(":")
        try:
            value = float(weight)
        except ValueError:
            value = -1.0
        if not location or not (value > 0 and math.isfinite(value)):
            raise ConfigError(
                f"training.dataset_mixture entry '{entry}' is not SOURCE:WEIGHT with a positive, finite weight "
                '(e.g. "data/web:0.7", "stdlib:0.3")'
            )
        mixture.append((parse_source(location, "training.dataset_mixture", **options), value))
    weights = [w for _, w in mixture]
    total = sum(weights)
    if not math.isfinite(total):
        raise ConfigError(
            f"training.dataset_mixture weights {', '.join(f'{w:g}' for w in weights)} overflow their sum; give them on "
            'a smaller scale (only their ratios count, e.g. "data/web:0.7", "stdlib:0.3")'
        )
    return mixture


def configured_sources(
    dataset: str, dataset_path: str, mixture: list[str], section: str = "training", **options
) -> list[tuple[Source, float]]:
    """The run's sources with their weights, from {section}.dataset / dataset_path or dataset_mixture;
    `options`: Source's (text_field, split, subset, data_files, data_dir, skip_unsupported)."""
    if mixture:
        if dataset_path:
            raise ConfigError(f"set either {section}.dataset_path or {section}.dataset_mixture, not both")
        return parse_mixture(mixture, **options)
    if dataset != "local" and dataset_path:
        raise ConfigError(f"{section}.dataset_path is only used with {section}.dataset = 'local'; unset it")
    if dataset == "stdlib":
        return [(Source("stdlib", "", f"{section}.dataset"), 1.0)]
    if dataset == "local":
        return [(Source("local", dataset_path, f"{section}.dataset_path", **options), 1.0)]
    return [(Source("hub", dataset, f"{section}.dataset", **options), 1.0)]


def build_corpus(
    sources: list[tuple[Source, float]],
    tokenizer: Tokenizer,
    stores: StoreOptions,
    seq_len: int,
    seed: int,
    shuffle: bool = True,
    *,
    holdout: float = 0.0,
) -> Corpus:
    """Open (preparing where needed) each source's store, hold out the last `holdout` of each but of those
    that hold back validation files of their own, and lay the remaining windows out in sample order."""
    opened = [stores.open(source, tokenizer) for source, _ in sources]
    split = [split_point(store, tokenizer.eot_id, 0.0 if store.held_files else holdout) for store in opened]
    parts = [PackedWindows(store, seq_len, stop=at) for store, at in zip(opened, split)]
    if len(sources) == 1:
        return Corpus(parts[0], EpochOrder(len(parts[0]), seed, shuffle), opened, split=split)
    weights = [weight for _, weight in sources]
    order = MixtureOrder([len(p) for p in parts], weights, seed, shuffle)
    return Corpus(MixedWindows(parts), order, opened, weights, split=split)
