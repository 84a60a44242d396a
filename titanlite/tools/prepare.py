"""`titanlite prepare`: tokenise the configured training data into its prepared token store, once.

Training ranks then only memory-map the store's shards. Run it ahead of a job on a large corpus (the
first `./run_train.sh` would otherwise do it before launch), or again after the sources changed.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from titanlite.base.command_line import take_options, usable_cores
from titanlite.base.errors import ConfigError
from titanlite.builder.data import describe_tokenizer, run_tokenizer, store_options, training_sources
from titanlite.builder.run import describe_model
from titanlite.config import DEFAULT_CONFIG, parse_config
from titanlite.data.store import describe

USAGE = """usage: titanlite prepare [--config FILE] [--workers N] [--rebuild] [--section.key VALUE ...]
  --workers N   tokenising processes, at most one per core (default: data.prepare_workers, 0 = every core)
  --rebuild     tokenise everything again, even where the store looks current (e.g. a hub dataset
                that changed upstream)
Sources are training.dataset / dataset_path, or every entry of training.dataset_mixture. A store is
reused when each source file's size, mtime and sampled fingerprint match (every byte, with
--data.verify_sources)."""

logger = logging.getLogger(__name__)


def prepare(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(USAGE)
        return 0
    opts, rest = take_options(argv, {"workers": -1, "rebuild": False}, "prepare", at_least={"workers": 0})
    check_workers(opts["workers"])
    cfg = parse_config(rest)
    options = store_options(cfg, "sample")
    if opts["workers"] >= 0:
        options = dataclasses.replace(options, workers=opts["workers"])
    tokenizer = run_tokenizer(cfg)
    logger.info(tokenizer_line(cfg, tokenizer, rest))
    sources = training_sources(cfg)
    for source, _ in sources:
        start = time.perf_counter()
        store = options.open(source, tokenizer, rebuild=opts["rebuild"])
        where = f" in {store.path}" if store.path else " (read in place)"
        logger.info(
            f"titanlite: prepared {describe(store)} with tokenizer {cfg.model.tokenizer}{where} "
            f"({time.perf_counter() - start:.1f} s)"
        )
    return 0


def check_workers(workers: int) -> None:
    """Tokenising is CPU-bound: past one process per usable core, more only share the same cores (and each holds its
    own tokenizer and buffers in memory), so a count above them is a mistake, refused before any work."""
    cores = usable_cores()
    if workers > cores:
        raise ConfigError(
            f"prepare --workers {workers} is more than the {cores} core(s) this process may use (tokenising is "
            f"CPU-bound: more processes than cores only share them); use at most {cores}, or 0 for every core"
        )


def tokenizer_line(cfg, tokenizer, argv: list[str]) -> str:
    """Which tokenizer the store is for: the one a run with these flags uses. Without --config or a model flag
    that is the default config's, which a run of another model does not share: said so."""
    line = (
        f"titanlite: tokenising with {describe_tokenizer(cfg, tokenizer)}, the tokenizer of model {describe_model(cfg)}"
    )
    if not any(arg.startswith(("--config", "--model.")) for arg in argv):
        line += f", the default config's ({DEFAULT_CONFIG}): give prepare the run's --config and model flags"
    return line
