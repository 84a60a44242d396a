"""A run's data: the tokenizer, the training corpus (windows and sample order) from prepared token stores,
the validation windows, and this rank's loader."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch

from titanlite.builder.plan import Plan, validation_batch_size
from titanlite.config import JobConfig
from titanlite.data.datasets import build_corpus, configured_sources, set_names, validation_windows
from titanlite.data.loader import TokenLoader
from titanlite.data.sources import Source
from titanlite.data.store import StoreOptions
from titanlite.data.tokenizer import build_tokenizer
from titanlite.engine.validator import num_windows


def cache_dir(cfg: JobConfig) -> Path:
    return Path(cfg.data.cache_dir or os.environ.get("TITANLITE_CACHE_DIR") or Path.home() / ".cache" / "titanlite")


def store_options(cfg: JobConfig, verify: str) -> StoreOptions:
    """How open_store checks and builds stores under this config: data.verify_sources turns a fingerprint
    check into a full one (ranks keep their stat check), plus the prepare workers and shard size."""
    d = cfg.data
    return StoreOptions(
        cache_dir(cfg),
        verify="full" if d.verify_sources and verify != "stat" else verify,
        workers=d.prepare_workers,
        shard_bytes=int(d.shard_size_mb * 2**20),
    )


def training_sources(cfg: JobConfig) -> list[tuple[Source, float]]:
    t = cfg.training
    options: dict[str, Any] = dict(
        text_field=t.dataset_text_field,
        split=t.dataset_split,
        subset=t.dataset_subset,
        data_files=tuple(t.dataset_data_files),
        data_dir=t.dataset_data_dir,
        skip_unsupported=cfg.data.skip_unsupported_files,
    )
    return configured_sources(t.dataset, t.dataset_path, t.dataset_mixture, **options)


def validation_sources(cfg: JobConfig, corpus) -> list[tuple[Source, float]]:
    """A separate validation corpus, or the validation files of the training sources that held some back (a
    pre-tokenised folder's val.bin and the like)."""
    v = cfg.validation
    if separate_validation(cfg):
        options = dict(
            text_field=v.dataset_text_field or cfg.training.dataset_text_field,
            split=v.dataset_split,
            subset=v.dataset_subset,
            skip_unsupported=cfg.data.skip_unsupported_files,
        )
        return configured_sources(v.dataset or "local", v.dataset_path, [], section="validation", **options)
    pairs = zip(training_sources(cfg), corpus.stores)
    return [(dataclasses.replace(source, split="validation"), w) for (source, w), store in pairs if store.held_files]


def build_data(cfg: JobConfig, tokenizer, verify: str = "stat"):
    """The corpus (windows and sample order) of the configured data in the run's tokenizer (its plan's), from
    prepared token stores.

    Training ranks check a store's sources by their folder listing, and size and mtime (verify='stat': no
    source is read); `titanlite check` and `prepare` also compare sampled fingerprints, or every byte with
    data.verify_sources. A missing or outdated store is built first, by one process at a time. Each
    source's last validation.split_fraction is held out of training unless validation names its own corpus
    or the source has its own validation files."""
    t = cfg.training
    sources = training_sources(cfg)
    holdout = 0.0 if separate_validation(cfg) else cfg.validation.split_fraction
    return build_corpus(
        sources, tokenizer, store_options(cfg, verify), t.seq_len, t.seed, cfg.data.shuffle, holdout=holdout
    )


def run_tokenizer(cfg: JobConfig):
    """The tokenizer a run of this config tokenises its data with, for `titanlite prepare`, which makes no plan
    (a run's own is its plan's, built by the same call: plan.plan_model), so that it builds the store the run opens."""
    return build_tokenizer(cfg.model.tokenizer, cfg.model.hf_assets_path)


def describe_tokenizer(cfg: JobConfig, tokenizer) -> str:
    """'hf (/models/x/tokenizer.json, 49,152 ids)', 'gpt2 (50,257 ids)'."""
    where = f"{Path(cfg.model.hf_assets_path) / 'tokenizer.json'}, " if cfg.model.tokenizer == "hf" else ""
    return f"{cfg.model.tokenizer} ({where}{tokenizer.vocab_size:,} ids)"


def separate_validation(cfg: JobConfig) -> bool:
    return bool(cfg.validation.dataset or cfg.validation.dataset_path)


def build_validation_data(cfg: JobConfig, tokenizer, corpus, verify: str = "stat"):
    """The validation windows: validation.dataset(_path) whole, the training sources' validation files, and
    the held-out tails of the training sources that have none."""
    v = cfg.validation
    seq_len = v.seq_len or cfg.training.seq_len
    options = store_options(cfg, verify)
    own = validation_sources(cfg, corpus)
    stores = [options.open(source, tokenizer) for source, _ in own]
    starts = [0] * len(stores)
    sources = [source for source, _ in own]
    if not separate_validation(cfg):
        tails = [
            (store, at, source)
            for store, at, (source, _) in zip(corpus.stores, corpus.split, training_sources(cfg))
            if at < len(store)
        ]
        stores, starts = stores + [s for s, _, _ in tails], starts + [at for _, at, _ in tails]
        sources += [source for _, _, source in tails]
    return validation_windows(stores, starts, seq_len, set_names(sources))


def build_loader(cfg: JobConfig, corpus, mesh, plan: Plan, device: torch.device) -> TokenLoader:
    return TokenLoader(
        corpus.windows,
        corpus.order,
        local_batch_size=cfg.training.local_batch_size,
        grad_accum_steps=plan.grad_accum_steps,
        dp_rank=dp_rank(mesh),
        dp_degree=plan.dims.dp,
        num_workers=cfg.data.num_workers,
        prefetch=cfg.data.prefetch,
        pin_device=device if cfg.data.pin_memory else None,
    )


def dp_rank(mesh) -> int:
    """Which data-parallel slice of each global batch this rank reads."""
    return mesh["dp"].get_local_rank() if mesh is not None and "dp" in mesh else 0


def describe_validation(
    cfg: JobConfig, corpus, windows: int, dp: int, schedule: bool = True, sets: list[tuple[str, int]] | None = None
) -> str:
    """One line: which windows each evaluation reads, from where, (schedule) when it runs, and the validation `sets`
    (their names and windows) where there are several."""
    v = cfg.validation
    if separate_validation(cfg):
        source = (
            f"validation.dataset_path '{v.dataset_path}'" if v.dataset_path else f"validation.dataset '{v.dataset}'"
        )
    elif any(store.held_files for store in corpus.stores):
        source = "the training folders' validation files"
        if not all(store.held_files for store in corpus.stores):
            source += f" and the held-out last {v.split_fraction * 100:g}% of the other training sources"
    else:
        source = f"the held-out last {v.split_fraction * 100:g}% of each training source"
    sizes = [size for _, size in sets] if sets else [windows]
    n = sum(num_windows(size, validation_batch_size(cfg), v.steps, dp) for size in sizes)
    seq_len = v.seq_len or cfg.training.seq_len
    when = f", every {v.freq} steps and at the last" if schedule else ""
    line = (
        f"validation: {n:,} windows of {seq_len} tokens ({n * seq_len:,} targets) from {source}{when}; "
        f"{validation_batch_size(cfg)} windows per rank per batch"
    )
    if sets:
        line += f"; {len(sets)} sets, each logged as val_loss/<name> ({', '.join(name for name, _ in sets)})"
    return line
