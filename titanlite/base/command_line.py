"""The command line below the entry points: a command's own `--name value` options, taken out of argv before the
rest is parsed as config overrides, and the entry points' module names, for the tools that start them as processes."""

from __future__ import annotations

from typing import Any

from titanlite.base.errors import ConfigError

# `python -m` names of the entry points (titanlite/commands/) that tools start as processes.
CLI = "titanlite.commands.cli"
LAUNCHER = "titanlite.commands.launch"  # torchrun with one-line failures; takes `-m WORKER` and its arguments
TRAIN_WORKER = "titanlite.commands.train"
EVAL_WORKER = "titanlite.commands.evaluate"


def take_options(argv: list[str], defaults: dict[str, Any], command: str) -> tuple[dict, list[str]]:
    """Pull a tool's `--name value` options out of argv, typed by their defaults (a bool default is a
    flag that takes no value); the rest of argv is config overrides. `command` prefixes errors."""
    values, rest, it = dict(defaults), [], iter(argv)
    for arg in it:
        key, has_inline, inline = arg.partition("=")
        name = key[2:]
        if not key.startswith("--") or name not in defaults:
            rest.append(arg)
            continue
        default = defaults[name]
        if isinstance(default, bool):
            values[name] = True
            continue
        value = inline if has_inline else next(it, "")
        try:
            values[name] = type(default)(value)
        except ValueError:
            kind = "a whole number" if isinstance(default, int) else "a number"
            raise ConfigError(f"{command} {key} takes {kind}, not '{value}'") from None
    return values, rest
