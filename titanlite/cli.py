"""The `titanlite` command: `train` (one process; use run_train.sh for several) and `check`.

`check` validates a config for a world size and prepares its token cache, before torchrun starts workers.
"""

from __future__ import annotations

import sys

from titanlite.errors import ConfigError

USAGE = """usage: titanlite <command> [--config FILE] [--section.key VALUE ...]
commands:
  train                     train in this process (./run_train.sh launches several with torchrun)
  check --world-size N      validate the config for N processes and prepare its data
  help                      list every config key with its default and meaning"""


def check(argv: list[str]) -> int:
    from titanlite.config import parse_config
    from titanlite.train import build_data, plan_run

    world_size, rest = 1, []
    it = iter(argv)
    for arg in it:
        if arg == "--world-size":
            world_size = int(next(it, "1"))
        elif arg.startswith("--world-size="):
            world_size = int(arg.split("=", 1)[1])
        else:
            rest.append(arg)
    try:
        cfg = parse_config(rest)
        plan = plan_run(cfg, world_size)
        build_data(cfg)
    except ConfigError as e:
        print(f"titanlite: error: {e}", file=sys.stderr)
        return 2
    print(
        f"titanlite: config ok for {world_size} process(es): {plan.dims.describe()}, "
        f"global batch {plan.global_batch_size}, accumulation {plan.grad_accum_steps}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command, rest = (argv[0], argv[1:]) if argv else ("help", [])
    if command == "check":
        return check(rest)
    if command == "train":
        from titanlite.train import main as train_main, shutdown

        shutdown(train_main(rest))
    if command in ("help", "--help", "-h"):
        from titanlite.config import help_text

        print(USAGE + "\n\n" + help_text())
        return 0
    print(f"titanlite: error: unknown command '{command}'\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
