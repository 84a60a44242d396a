"""The `titanlite` command: `train` (one process; use run_train.sh for several), `check`, `prepare` and tools.

`check` validates a config for a world size and prepares its token store, before torchrun starts workers.
"""

from __future__ import annotations

import difflib
import os
import sys
from pathlib import Path

from titanlite.base import logs
from titanlite.base.errors import ConfigError
from titanlite.config import help_text, parse_config, reference_markdown, refuse_repeated_keys  # torch-free

USAGE = """usage: titanlite <command> [--config FILE] [--section.key VALUE ...]
commands:
  train                     train in this process (./run_train.sh launches several with torchrun)
  check --world-size N [--nproc-per-node K]
                            validate the config for N processes (K per node) and prepare its data
  prepare [--workers N --rebuild]
                            tokenise the configured corpus (or mixture) into its prepared token
                            store, with progress; an interrupted prepare continues where it stopped
  eval [--ngpu N --output F.json]
       [--tasks T1,T2 --include-path DIR --limit N --num-fewshot K --bootstrap-iters N --log-samples]
                            the validation loss and perplexity of the run's newest checkpoint (or
                            checkpoint.load_step, else checkpoint.initial_load_path) on the configured
                            layout over N processes; the same windows as the run's evaluations; with
                            --tasks, its lm-evaluation-harness scores on those tasks instead
  seed-checkpoint           write step-0/ (initial weights, model only) to the run folder, in one process
  convert to-hf --output DIR
                            export the run's newest checkpoint (or checkpoint.load_step) as a Hugging
                            Face folder (config.json, safetensors in checkpoint.export_dtype, tokenizer files,
                            generation_config.json) that transformers loads offline
  generate --prompt TEXT [--max-new-tokens N --temperature T --top-k K --seed S --output F.json]
                            [--cuda-graph | --no-cuda-graph]
                            continue TEXT with the run's newest checkpoint (or checkpoint.load_step, else
                            checkpoint.initial_load_path) on one device: greedy at temperature 0, with a KV cache
  logits --prompt TEXT [--top K --all-positions --compare --no-compare]
                            the prompt's top K next ids and their logits at its last position (or every one), in
                            float32 on the CPU; for a Hugging Face folder, beside transformers' (by default where
                            it is installed), with the largest difference over every position and id
  bench throughput [--steps N --warmup W --repeats R --no-bare --output F.json]
                            tokens/s, TFLOPs, MFU and peak memory of one device, beside a bare
                            PyTorch loop on the same model (see `titanlite bench throughput --help`)
  bench strategies [--ngpu N --steps S --output DIR]
                            single device, DDP, ZeRO-2, ZeRO-3, HSDP, TP, PP on N processes, profiled:
                            one Markdown table and a PNG chart
  bench data [--mb M --zst --files N --workers N --repeats R --output F.json --keep DIR]
                            prepare speed beside raw tiktoken, prepare's peak memory and the time to
                            open a prepared store, on a generated JSONL corpus of M MB
  bench batch-sizes [--steps S --max-batch-size B --output DIR]
                            tokens/s and peak memory at local batch 1, 2, 4, ... until out of memory
  plan [--ngpu N --nnodes M --gpu-mem-gib G --gpu-tflops T --headroom F --device cuda|cpu]
                            [--interconnect nvlink|pcie|infiniband --top N --measure]
                            per-rank memory and communication of every layout, on the meta device;
                            which fit, which to use; --measure checks the estimate on a real run
  analyze <trace folder or file> [--top N]
                            compute / communication / idle shares, overlap and collectives of a run's
                            torch.profiler traces (profiling.enable_profiling); writes analysis.json/.md
  compare RUN_DIR RUN_DIR [...] [--output FILE.png --metrics M,M --max-diff X]
                            per metric of the runs' metrics.jsonl (loss, grad_norm, val_loss, aux
                            terms, ...): the steps in common and the largest relative difference from
                            the first run; a PNG of loss, val_loss, grad norm and tokens/s (or --metrics) by step
  help [--markdown]         list every config key with its default and meaning (--markdown: the table
                            of docs/configuration.md)"""


# Each command imports its module when it runs, not at start-up: the modules behind them import torch and
# its distributed stack (seconds), which `titanlite help` and a mistyped command should not pay for.


def check(argv: list[str]) -> int:
    from titanlite.commands.check import check as run_check  # lazy: start-up time (above)

    return run_check(argv)


def evaluate(argv: list[str]) -> int:
    from titanlite.commands.evaluate import eval_command  # lazy: start-up time (above)

    return eval_command(argv)


def prepare(argv: list[str]) -> int:
    from titanlite.tools.prepare import prepare as run_prepare  # lazy: start-up time (above)

    return run_prepare(argv)


def seed_checkpoint(argv: list[str]) -> int:
    from titanlite.commands.convert import seed_checkpoint as run_seed_checkpoint  # lazy: start-up time (above)

    return run_seed_checkpoint(argv)


def convert(argv: list[str]) -> int:
    from titanlite.commands.convert import convert as run_convert  # lazy: start-up time (above)

    return run_convert(argv)


def generate(argv: list[str]) -> int:
    from titanlite.commands.generate import main as run_generate  # lazy: start-up time (above)

    return run_generate(argv)


def logits(argv: list[str]) -> int:
    from titanlite.commands.logits import main as run_logits  # lazy: start-up time (above)

    return run_logits(argv)


BENCHES = ("throughput", "strategies", "batch-sizes", "data")


def bench(argv: list[str]) -> int:
    """Only the chosen benchmark's module is imported: `bench data` never needs torch (seconds of start-up, and a
    mistyped option of it is answered at once)."""
    what, rest = (argv[0], argv[1:]) if argv else ("", [])
    if what == "data":
        from titanlite.tools.bench_data import bench_data  # lazy: start-up time (above)

        return bench_data(rest)
    if what == "throughput":
        from titanlite.tools.bench import throughput  # lazy: start-up time (above)

        return throughput(rest)
    if what in ("strategies", "batch-sizes"):
        from titanlite.tools import strategies  # lazy: start-up time (above)

        return strategies.strategies(rest) if what == "strategies" else strategies.batch_sizes(rest)
    raise ConfigError(f"bench takes one of {', '.join(BENCHES)}, not '{what}'")


def plan(argv: list[str]) -> int:
    from titanlite.tools.plan import plan as run_plan  # lazy: start-up time (above)

    return run_plan(argv)


def analyze(argv: list[str]) -> int:
    from titanlite.tools.analyze import main as run_analyze  # lazy: start-up time (above)

    return run_analyze(argv)


def compare(argv: list[str]) -> int:
    from titanlite.commands.compare import compare as run_compare  # lazy: start-up time (above)

    return run_compare(argv)


def train(argv: list[str]) -> None:
    from titanlite.commands.train import main as train_main  # lazy: start-up time (above)
    from titanlite.commands.worker import shutdown  # lazy: start-up time (above)
    from titanlite.components import run_lock  # lazy: start-up time (above)

    cfg = parse_config(argv) if "--help" not in argv and "-h" not in argv else None
    lock = run_lock.acquire(Path(cfg.job.dump_folder) / cfg.job.name, f"titanlite train {os.getpid()}") if cfg else None
    code = train_main(argv)
    if lock is not None:
        lock.release()
    shutdown(code)


# Commands that run in this process; a ConfigError from any of them is one line and status 2.
COMMANDS = {
    "check": check,
    "eval": evaluate,
    "prepare": prepare,
    "seed-checkpoint": seed_checkpoint,
    "convert": convert,
    "generate": generate,
    "logits": logits,
    "bench": bench,
    "plan": plan,
    "analyze": analyze,
    "compare": compare,
}


# Commands whose own parser prints a fuller help for `--help` (with its options' defaults); bench's four each do.
OWN_HELP = ("prepare", "plan", "analyze", "compare")
HELP = ("-h", "--help")


def command_usage(command: str) -> str:
    """USAGE's entry (or entries: bench's four) for one command, as that command's `--help`, and where the
    config keys every command takes are listed."""
    entries: list[str] = []
    keep = False
    for line in USAGE.splitlines()[2:]:
        if not line.startswith("    "):  # an entry's first line; its continuation lines are indented further
            keep = line.split()[0] == command
            line = ("usage: " if not entries else "       ") + "titanlite " + line[2:]
        if keep:
            entries.append(line)
    return (
        "\n".join(entries)
        + "\n\nIt also takes --config FILE and --section.key VALUE overrides of the config;"
        + " `titanlite help` lists each key with its default."
    )


def wants_help(command: str, rest: list[str]) -> bool:
    """`titanlite COMMAND --help` for a command without a help of its own (bench's sub-commands and OWN_HELP print
    theirs)."""
    if command in OWN_HELP or (command == "bench" and rest[:1] and rest[0] in BENCHES):
        return False
    return any(arg in HELP for arg in rest)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logs.set_up()
    command, rest = (argv[0], argv[1:]) if argv else ("help", [])
    if command in COMMANDS and wants_help(command, rest):
        print(command_usage(command))
        return 0
    if command in COMMANDS:
        try:
            refuse_repeated_keys(rest)
            return COMMANDS[command](rest)
        except ConfigError as e:
            print(f"titanlite: error: {e}", file=sys.stderr)
            return 2
    if command == "train":
        try:
            refuse_repeated_keys(rest)
            train(rest)
        except ConfigError as e:
            print(f"titanlite: error: {e}", file=sys.stderr)
            return 2
    if command in ("help", "--help", "-h"):
        print(reference_markdown() if "--markdown" in rest else USAGE + "\n\n" + help_text())
        return 0
    print(f"titanlite: error: {unknown_command(command)}", file=sys.stderr)
    return 2


def unknown_command(command: str) -> str:
    """The one line for a command titanlite does not have: the closest ones it has, and where they are listed."""
    close = difflib.get_close_matches(command, [*COMMANDS, "train", "help"], n=2, cutoff=0.6)
    if command.startswith("-"):
        hint = " (the command comes first: titanlite COMMAND [--config FILE] [--section.key VALUE ...])"
    elif close:
        hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)"
    else:
        hint = ""
    return f"unknown command '{command}'{hint}; see titanlite --help"


if __name__ == "__main__":
    sys.exit(main())
