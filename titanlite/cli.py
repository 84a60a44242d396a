"""The `titanlite` command: `train` (one process; use run_train.sh for several), `check`, `prepare` and tools.

`check` validates a config for a world size and prepares its token store, before torchrun starts workers.
"""

from __future__ import annotations

import sys

from titanlite.errors import ConfigError

USAGE = """usage: titanlite <command> [--config FILE] [--section.key VALUE ...]
commands:
  train                     train in this process (./run_train.sh launches several with torchrun)
  check --world-size N [--nproc-per-node K]
                            validate the config for N processes (K per node) and prepare its data
  prepare [--workers N --rebuild]
                            tokenise the configured corpus (or mixture) into its prepared token
                            store, with progress; an interrupted prepare continues where it stopped
  eval [--ngpu N --output F.json]
                            the validation loss and perplexity of the run's newest checkpoint (or
                            checkpoint.load_step, else checkpoint.initial_load_path) on the configured
                            layout over N processes; the same windows as the run's evaluations
  seed-checkpoint           write step-0/ (initial weights, model only) to the run folder, in one process
  convert to-hf --output DIR
                            export the run's newest checkpoint (or checkpoint.load_step) as a Hugging
                            Face folder (config.json, safetensors in checkpoint.export_dtype, tokenizer files,
                            generation_config.json) that transformers loads offline
  generate --prompt TEXT [--max-new-tokens N --temperature T --top-k K --seed S --output F.json]
                            continue TEXT with the run's newest checkpoint (or checkpoint.load_step, else
                            checkpoint.initial_load_path) on one device: greedy at temperature 0, with a KV cache
  bench throughput [--steps N --warmup W --repeats R --no-bare --output F.json]
                            tokens/s, TFLOPs, MFU and peak memory of one device, beside a bare
                            PyTorch loop on the same model (see `titanlite bench throughput --help`)
  bench strategies [--ngpu N --steps S --output DIR]
                            single device, DDP, ZeRO-2, ZeRO-3, HSDP, TP, PP on N processes, profiled:
                            one Markdown table and a PNG chart
  bench data [--mb M --output F.json]
                            prepare speed beside raw tiktoken, prepare's peak memory and the time to
                            open a prepared store, on a generated JSONL corpus of M MB
  bench batch-sizes [--steps S --max-batch-size B --output DIR]
                            tokens/s and peak memory at local batch 1, 2, 4, ... until out of memory
  plan [--ngpu N --nnodes M --gpu-mem-gib G --interconnect nvlink|pcie --measure]
                            per-rank memory and communication of every layout, on the meta device;
                            which fit, which to use; --measure checks the estimate on a real run
  analyze <trace folder or file> [--top N]
                            compute / communication / idle shares, overlap and collectives of a run's
                            torch.profiler traces (profiling.enable_profiling); writes analysis.json/.md
  help [--markdown]         list every config key with its default and meaning (--markdown: the table
                            of docs/configuration.md)"""


def _take_option(argv: list[str], name: str) -> tuple[str | None, list[str]]:
    """Remove `--name VALUE` / `--name=VALUE` from argv."""
    value, rest, it = None, [], iter(argv)
    for arg in it:
        if arg == f"--{name}":
            value = next(it, None)
        elif arg.startswith(f"--{name}="):
            value = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    return value, rest


def _plain_model(cfg):
    """The configured model, whole, on the CPU of this one process."""
    from titanlite.data.tokenizer import build_tokenizer
    from titanlite.models.registry import configured_model

    m = cfg.model
    return configured_model(m, build_tokenizer(m.tokenizer, m.hf_assets_path).vocab_size, cfg.training.seq_len)


def seed_checkpoint(argv: list[str]) -> int:
    from pathlib import Path

    from titanlite.checkpoint import save_model_only
    from titanlite.config import parse_config
    from titanlite.parallel.parallelize import init_weights

    cfg = parse_config(argv)
    model = _plain_model(cfg)
    init_weights(model, cfg.training.seed)
    path = save_model_only(Path(cfg.job.dump_folder) / cfg.job.name, 0, model.state_dict())
    print(f"titanlite: wrote the seed checkpoint {path}; runs with checkpoint.enable load it on any layout")
    return 0


def convert(argv: list[str]) -> int:
    from pathlib import Path

    import torch

    from titanlite.checkpoint import load_model_only, pick_checkpoint
    from titanlite.config import parse_config
    from titanlite.data.tokenizer import build_tokenizer
    from titanlite.hf import save_hf

    if not argv or argv[0] != "to-hf":
        raise ConfigError("convert takes 'to-hf --output DIR'; to import a Hugging Face folder set checkpoint.initial_load_path")
    output, rest = _take_option(argv[1:], "output")
    if not output:
        raise ConfigError("convert to-hf needs --output DIR")
    cfg = parse_config(rest)
    run_dir = Path(cfg.job.dump_folder) / cfg.job.name
    path = pick_checkpoint(run_dir, cfg.checkpoint.load_step)
    if path is None:
        raise ConfigError(f"no complete checkpoint in {run_dir}; train with checkpoint.enable first")
    model = _plain_model(cfg)
    load_model_only(path, model)
    m = cfg.model
    tokenizer = build_tokenizer(m.tokenizer, m.hf_assets_path)
    save_hf(output, model.args, model.state_dict(), dtype=getattr(torch, cfg.checkpoint.export_dtype),
            tokenizer=tokenizer, max_shard_bytes=int(cfg.checkpoint.export_max_shard_gb * 2**30))
    print(f"titanlite: exported {path} to {output} ({cfg.checkpoint.export_dtype}, tokenizer {m.tokenizer}); "
          "AutoModelForCausalLM and AutoTokenizer load it offline")
    return 0


def generate(argv: list[str]) -> int:
    from titanlite.generate import main as run_generate

    return run_generate(argv)


def check(argv: list[str]) -> int:
    from titanlite.config import parse_config
    from titanlite.devices import check_local_ranks
    from titanlite.preflight import memory_preflight
    from titanlite.tools import take_options
    from titanlite.train import build_data, build_validation_data, describe_validation, plan_run

    opts, rest = take_options(argv, {"world-size": 1, "nproc-per-node": 0}, "check")
    world_size = opts["world-size"]
    local_ranks = opts["nproc-per-node"] or world_size
    cfg = parse_config(rest)
    check_local_ranks(local_ranks)
    plan = plan_run(cfg, world_size)
    tokenizer, corpus = build_data(cfg, verify="sample", say=lambda line: print(line, flush=True))
    for line in corpus.describe(plan.global_batch_size * cfg.training.steps):
        print(f"titanlite: data: {line}")
    memory_preflight(cfg, world_size, local_ranks, say=lambda line: print(line, flush=True))
    if cfg.validation.enable:
        windows = build_validation_data(cfg, tokenizer, corpus, verify="sample", say=lambda line: print(line, flush=True))
        print(f"titanlite: {describe_validation(cfg, len(windows), plan.dims.dp)}")
    print(
        f"titanlite: config ok for {world_size} process(es): {plan.dims.describe()}, "
        f"global batch {plan.global_batch_size}, accumulation {plan.grad_accum_steps}"
    )
    return 0


def prepare(argv: list[str]) -> int:
    from titanlite.tools.prepare import prepare as run_prepare

    return run_prepare(argv)


def bench(argv: list[str]) -> int:
    from titanlite.tools import bench as tools, bench_data, strategies

    commands = {"throughput": tools.throughput, "strategies": strategies.strategies, "batch-sizes": strategies.batch_sizes,
                "data": bench_data.bench_data}
    what, rest = (argv[0], argv[1:]) if argv else ("", [])
    if what not in commands:
        raise ConfigError(f"bench takes one of {', '.join(commands)}, not '{what}'")
    return commands[what](rest)


def plan(argv: list[str]) -> int:
    from titanlite.tools.plan import plan as run_plan

    return run_plan(argv)


def evaluate(argv: list[str]) -> int:
    from titanlite.validate import eval_command

    return eval_command(argv)


def analyze(argv: list[str]) -> int:
    from titanlite.tools.analyze import main as run_analyze

    return run_analyze(argv)


# Commands that run in this process; a ConfigError from any of them is one line and status 2.
COMMANDS = {"check": check, "eval": evaluate, "prepare": prepare, "seed-checkpoint": seed_checkpoint, "convert": convert, "generate": generate,
            "bench": bench, "plan": plan, "analyze": analyze}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command, rest = (argv[0], argv[1:]) if argv else ("help", [])
    if command in COMMANDS:
        try:
            return COMMANDS[command](rest)
        except ConfigError as e:
            print(f"titanlite: error: {e}", file=sys.stderr)
            return 2
    if command == "train":
        from titanlite.train import main as train_main, shutdown

        shutdown(train_main(rest))
    if command in ("help", "--help", "-h"):
        from titanlite.config import help_text, reference_markdown

        print(reference_markdown() if "--markdown" in rest else USAGE + "\n\n" + help_text())
        return 0
    print(f"titanlite: error: unknown command '{command}'\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
