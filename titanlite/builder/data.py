"""A run's data: the tokenizer, the training corpus (windows and sample order) from prepared token stores,
the validation windows, and this rank's loader."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from titanlite.builder.plan import Plan, validation_batch_size
from titanlite.config import JobConfig
from titanlite.data.datasets import build_corpus, configured_sources, validation_windows
from titanlite.data.loader import TokenLoader
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


def build_data(cfg: JobConfig, verify: str = "stat", say=None):
    """Tokenizer and corpus (windows and sample order) of the configured data, from prepared token stores.

    Training ranks check a store's sources by size and mtime only (verify='stat': no source is read);
    `titanlite check` and `prepare` also compare sampled fingerprints, or every byte with
    data.verify_sources. A missing or outdated store is built first, by one process at a time. Each
    source's last validation.split_fraction is held out of training unless validation names its own corpus."""
    t = cfg.training
    tokenizer = build_tokenizer(cfg.model.tokenizer, cfg.model.hf_assets_path)
    sources = configured_sources(t.dataset, t.dataset_path, t.dataset_mixture)
    holdout = 0.0 if separate_validation(cfg) else cfg.validation.split_fraction
    corpus = build_corpus(
        sources, tokenizer, store_options(cfg, verify), t.seq_len, t.seed, cfg.data.shuffle, holdout=holdout, say=say
    )
    return tokenizer, corpus


def separate_validation(cfg: JobConfig) -> bool:
    return bool(cfg.validation.dataset or cfg.validation.dataset_path)


def build_validation_data(cfg: JobConfig, tokenizer, corpus, verify: str = "stat", say=None):
    """The validation windows: the training corpus's held-out tails, or validation.dataset(_path) whole."""
    v = cfg.validation
    seq_len = v.seq_len or cfg.training.seq_len
    if not separate_validation(cfg):
        return validation_windows(corpus.stores, corpus.split, seq_len)
    sources = configured_sources(v.dataset or "local", v.dataset_path, [], section="validation")
    options = store_options(cfg, verify)
    stores = [options.open(source, tokenizer, say=say) for source, _ in sources]
    return validation_windows(stores, [0] * len(stores), seq_len)


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


def describe_validation(cfg: JobConfig, windows: int, dp: int, schedule: bool = True) -> str:
    """One line: which windows each evaluation reads, from where, and (schedule) when it runs."""
    v = cfg.validation
    if separate_validation(cfg):
        source = (
            f"validation.dataset_path '{v.dataset_path}'" if v.dataset_path else f"validation.dataset '{v.dataset}'"
        )
    else:
        source = f"the held-out last {v.split_fraction * 100:g}% of each training source"
    n = num_windows(windows, validation_batch_size(cfg), v.steps, dp)
    seq_len = v.seq_len or cfg.training.seq_len
    when = f", every {v.freq} steps and at the last" if schedule else ""
    return (
        f"validation: {n:,} windows of {seq_len} tokens ({n * seq_len:,} targets) from {source}{when}; "
        f"{validation_batch_size(cfg)} windows per rank per batch"
    )
