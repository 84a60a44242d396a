"""`titanlite eval`: the validation loss and perplexity of a run's checkpoint on the configured layout, or with
`--tasks` its scores on lm-evaluation-harness tasks (titanlite/engine/downstream.py).

The command checks everything it can in its own process (the tasks' documents load there, once), then evaluates
there (one process) or in N torchrun workers, each running this module (`-m titanlite.commands.evaluate`); rank 0
prints the result.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import torch.distributed as dist

from titanlite.base.command_line import (
    EVAL_WORKER,
    check_output_file,
    local_launch,
    take_options,
    write_output,
)
from titanlite.base.devices import check_local_ranks
from titanlite.base.errors import ConfigError
from titanlite.builder.data import build_data, build_validation_data, describe_validation
from titanlite.builder.model import build_rank_model
from titanlite.builder.plan import Plan, plan_run
from titanlite.builder.run import build_scorer, build_validator, describe_model
from titanlite.builder.runtime import start_rank
from titanlite.commands.worker import exit_from, run_worker
from titanlite.components.checkpoint import checkpoint_to_load, load_weights, parse_run_config
from titanlite.config import JobConfig
from titanlite.engine.downstream import (
    check_tasks,
    results_json,
    results_table,
    score_tasks,
    task_manager,
    titanlite_lm,
)
from titanlite.engine.validator import set_sizes

OPTIONS = {
    "ngpu": 1,
    "output": "",
    # downstream tasks: each sets its [downstream] key for this command (the config's, or the run's recorded one,
    # otherwise); without --tasks the command evaluates the validation loss
    "tasks": "",
    "include-path": "",
    "limit": -1,
    "num-fewshot": -2,
    "bootstrap-iters": 100000,  # lm-eval's resamplings for the standard errors of its non-mean metrics (0: none)
    "log-samples": False,  # --output also holds every document's requests and the model's answers (lm-eval's samples)
}
TASK_KEYS = {"tasks": "tasks", "include-path": "include_path", "limit": "limit", "num-fewshot": "num_fewshot"}
UNSET = {"tasks": "", "include-path": "", "limit": -1, "num-fewshot": -2}
WORKER_OPTIONS = {"output": "", "bootstrap-iters": 100000, "log-samples": False}

logger = logging.getLogger(__spec__.name)  # not __name__: under `python -m` this module is __main__


def eval_command(argv: list[str]) -> int:
    """`titanlite eval [--ngpu N] [--output F.json] [--tasks T1,T2 ...]`: checks everything it can in this process,
    then evaluates here (N = 1) or in N torchrun workers; rank 0 prints the result."""
    opts, rest = take_options(argv, OPTIONS, "eval", at_least={"bootstrap-iters": 0, "limit": 0, "num-fewshot": -1})
    check_output_file(opts["output"], "eval --output")
    given = [k for k in TASK_KEYS if opts[k] != UNSET[k]]
    # The tasks are --tasks's (or --downstream.tasks's): a config file's [downstream] tasks are its run's, scored in
    # its loop, so without either none, in this process and in every worker that reads the same command line.
    tasks = bool(opts["tasks"]) or any(arg.partition("=")[0] == "--downstream.tasks" for arg in rest)
    if opts["log-samples"] and not (tasks and opts["output"]):
        raise ConfigError("eval --log-samples writes lm-eval's samples into --output F.json; give --tasks and --output")
    if given and not tasks:
        raise ConfigError(f"eval --{given[0]} applies to downstream tasks; name them with --tasks T1,T2")
    task_options = [f"--downstream.{TASK_KEYS[k]}={opts[k]}" for k in given]
    rest = [*rest, *task_options, *([] if tasks else ["--downstream.tasks="])]
    cfg = parse_run_config(rest, evaluation=True)  # the model and windows the run had, without its flags repeated
    if opts["ngpu"] < 1:
        raise ConfigError(f"eval --ngpu {opts['ngpu']} must be at least 1")
    check_local_ranks(opts["ngpu"])
    plan = plan_run(cfg, opts["ngpu"], evaluation=True)
    checkpoint_to_load(cfg, "evaluate", contents=False)  # its workers verify the contents, sharing the work
    if cfg.downstream.tasks:
        check_tasks(cfg.downstream, plan.model.tokenizer)
    else:
        corpus = build_data(cfg, plan.model.tokenizer, verify="sample")
        build_validation_data(cfg, plan.model.tokenizer, corpus, verify="sample")
    worker_opts = {k: opts[k] for k in WORKER_OPTIONS}
    if opts["ngpu"] == 1:  # no process group: the worker runs here, on the config and plan made above, and returns
        return run_worker(lambda cfg: evaluate(cfg, worker_opts, plan), rest, lambda _: cfg)
    options = ["--output", opts["output"], "--bootstrap-iters", str(opts["bootstrap-iters"])]
    options += ["--log-samples"] if opts["log-samples"] else []
    cmd, env = local_launch(opts["ngpu"], EVAL_WORKER, [*options, *rest])
    return subprocess.run(cmd, env=env).returncode


def evaluate(cfg: JobConfig, opts: dict, plan: Plan | None = None) -> dict:
    """One worker of `titanlite eval`: the configured layout's model with a checkpoint's weights, evaluated once
    (validation, or the downstream tasks). `plan`: the one `titanlite eval` made in this process already (one
    process: no torchrun worker plans again)."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    plan = plan or plan_run(cfg, world_size, evaluation=True)
    device = start_rank(cfg, plan, world_size)
    mesh = plan.dims.build_mesh(device.type)
    if cfg.downstream.tasks:
        return score(cfg, plan, mesh, device, opts)
    corpus = build_data(cfg, plan.model.tokenizer)
    windows = build_validation_data(cfg, plan.model.tokenizer, corpus)
    setup = build_rank_model(cfg, plan, mesh, device)
    validator = build_validator(cfg, plan, setup, mesh, windows)
    logger.info(
        f"titanlite eval: {describe_model(cfg)} on {plan.dims.describe()}; "
        f"{describe_validation(cfg, corpus, len(windows), plan.dims.dp, False, set_sizes(windows))}"
    )
    path = checkpoint_to_load(cfg, "evaluate")
    load_weights(setup.rank.parts, path)
    result = validator.run()
    report(result, path, opts["output"])
    return result


def score(cfg: JobConfig, plan: Plan, mesh, device, opts: dict) -> dict:
    """`titanlite eval --tasks`: lm-eval's results for the tasks, scored on this layout; rank 0 prints lm-eval's
    table and writes its results JSON to --output."""
    setup = build_rank_model(cfg, plan, mesh, device)
    scorer = build_scorer(cfg, plan, setup, mesh, device)
    manager = task_manager(cfg.downstream)
    lm = titanlite_lm(scorer, plan.model.tokenizer, scorer.shape.max_len)
    path = checkpoint_to_load(cfg, "evaluate")
    load_weights(setup.rank.parts, path)
    speaks = not dist.is_initialized() or dist.get_rank() == 0
    if speaks:
        logger.info(
            f"titanlite eval: {describe_model(cfg)} on {plan.dims.describe()}; "
            f"tasks {', '.join(cfg.downstream.tasks)}; "
            f"{scorer.shape.rows} requests per rank per forward, inputs up to {scorer.shape.max_len} tokens"
        )
    start = time.perf_counter()
    results = score_tasks(lm, cfg.downstream, manager, opts["bootstrap-iters"], opts["log-samples"])
    seconds = time.perf_counter() - start
    if speaks:
        print(results_table(results), flush=True)
        logger.info(
            f"titanlite eval: {path}: {scorer.requests} requests in {seconds:.1f}s ({scorer.forwards} forwards)"
        )
        if opts["output"]:
            results = {**results, "checkpoint": str(path)}
            write_output(opts["output"], results_json(results))
    return results


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
    opts, rest = take_options(sys.argv[1:] if argv is None else argv, WORKER_OPTIONS, "eval")
    return run_worker(lambda cfg: evaluate(cfg, opts), rest, lambda argv: parse_run_config(argv, evaluation=True))


if __name__ == "__main__":
    exit_from(main)
