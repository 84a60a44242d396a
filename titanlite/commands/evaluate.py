"""`titanlite eval`: the validation loss and perplexity of a run's checkpoint on the configured layout.

The command checks everything it can in its own process, then evaluates there (one process) or in N
torchrun workers, each running this module (`-m titanlite.commands.evaluate`); rank 0 prints the result.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

from titanlite.base.command_line import EVAL_WORKER, LAUNCHER, check_output_file, take_options, write_output
from titanlite.base.devices import check_local_ranks
from titanlite.base.errors import ConfigError
from titanlite.builder.data import build_data, build_validation_data, describe_validation
from titanlite.builder.model import build_rank_model
from titanlite.builder.plan import Plan, plan_run
from titanlite.builder.run import build_validator, describe_model
from titanlite.builder.runtime import start_rank
from titanlite.commands.worker import exit_from, run_worker
from titanlite.components.checkpoint import checkpoint_to_load, load_weights, parse_run_config
from titanlite.config import JobConfig

OPTIONS = {"ngpu": 1, "output": ""}

logger = logging.getLogger(__spec__.name)  # not __name__: under `python -m` this module is __main__


def eval_command(argv: list[str]) -> int:
    """`titanlite eval [--ngpu N] [--output F.json]`: checks everything it can in this process, then
    evaluates here (N = 1) or in N torchrun workers; rank 0 prints the result."""
    opts, rest = take_options(argv, OPTIONS, "eval")
    check_output_file(opts["output"], "eval --output")
    cfg = parse_run_config(rest, evaluation=True)  # the model and windows the run had, without its flags repeated
    if opts["ngpu"] < 1:
        raise ConfigError(f"eval --ngpu {opts['ngpu']} must be at least 1")
    check_local_ranks(opts["ngpu"])
    plan = plan_run(cfg, opts["ngpu"], evaluation=True)
    checkpoint_to_load(cfg, "evaluate", contents=False)  # its workers verify the contents, sharing the work
    corpus = build_data(cfg, plan.model.tokenizer, verify="sample")
    build_validation_data(cfg, plan.model.tokenizer, corpus, verify="sample")
    if opts["ngpu"] == 1:  # no process group: the worker runs here, on the config and plan made above, and returns
        return run_worker(lambda cfg: evaluate(cfg, opts["output"], plan), rest, lambda _: cfg)
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    cmd = [
        sys.executable,
        "-m",
        LAUNCHER,
        "--standalone",
        f"--nproc-per-node={opts['ngpu']}",
        "-m",
        EVAL_WORKER,
        "--output",
        opts["output"],
        *rest,
    ]
    return subprocess.run(cmd, env=env).returncode


def evaluate(cfg: JobConfig, output: str = "", plan: Plan | None = None) -> dict:
    """One worker of `titanlite eval`: the configured layout's model with a checkpoint's weights, evaluated once.
    `plan`: the one `titanlite eval` made in this process already (one process: no torchrun worker plans again)."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    plan = plan or plan_run(cfg, world_size, evaluation=True)
    device = start_rank(cfg, plan, world_size)
    mesh = plan.dims.build_mesh(device.type)
    corpus = build_data(cfg, plan.model.tokenizer)
    windows = build_validation_data(cfg, plan.model.tokenizer, corpus)
    setup = build_rank_model(cfg, plan, mesh, device)
    validator = build_validator(cfg, plan, setup, mesh, windows)
    logger.info(
        f"titanlite eval: {describe_model(cfg)} on {plan.dims.describe()}; "
        f"{describe_validation(cfg, corpus, len(windows), plan.dims.dp, schedule=False)}"
    )
    path = checkpoint_to_load(cfg, "evaluate")
    load_weights(setup.rank.parts, path)
    result = validator.run()
    report(result, path, output)
    return result


def report(result: dict, path: Path, output: str) -> None:
    """Print the figures; rank 0 also writes them to `output` (--output F.json) when one is named."""
    logger.info(
        f"titanlite eval: {path}: val_loss {result['val_loss']:.4f}  val_perplexity {result['val_perplexity']:.2f}  "
        f"val_tokens {result['val_tokens']:,}  ({result['val_seconds']:.1f}s)"
    )
    if output and (not dist.is_initialized() or dist.get_rank() == 0):
        write_output(output, json.dumps({**result, "checkpoint": str(path)}, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    """A torchrun worker of `titanlite eval --ngpu N`."""
    opts, rest = take_options(sys.argv[1:] if argv is None else argv, {"output": ""}, "eval")
    return run_worker(
        lambda cfg: evaluate(cfg, opts["output"]), rest, lambda argv: parse_run_config(argv, evaluation=True)
    )


if __name__ == "__main__":
    exit_from(main)
