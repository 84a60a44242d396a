"""Every option a command's parser takes is in its usage line: the `usage:` lines of `titanlite COMMAND --help`, and
the command's entry in `titanlite help`'s list. The options are the ones each command hands to take_options
(titanlite/base/command_line.py), caught on their way in, in this process, before the command does anything."""

import importlib
import pkgutil
import re

import pytest

import titanlite.commands
import titanlite.tools
from titanlite.base import command_line
from titanlite.commands import cli

WORDS = sorted({line.split()[0] for line in cli.USAGE.splitlines()[2:] if not line.startswith("    ")})
COMMANDS = [[c] for c in WORDS if c not in ("help", "train", "bench", "convert")]
COMMANDS += [["bench", sub] for sub in cli.BENCHES] + [["convert", "to-hf"]]


# Modules that set up the process importing them (the launcher's forkserver ignores SIGTERM and SIGHUP and dies with
# its parent): imported here, a test process would ignore SIGTERM from then on, and so would every process it forks
# (a multiprocessing pool's terminate() then waits forever). They take no options.
PROCESS_MODULES = ("fork_server",)


class Taken(Exception):
    """Raised by the stand-in take_options once it has seen a command's options: nothing after it runs."""


def parser_options(words: list[str], monkeypatch, tmp_path) -> list[str]:
    """The `--name`s the command's take_options call accepts ([] for a command that takes none)."""
    seen: list[str] = []

    def take(argv, defaults, command, at_least=None):
        seen.extend(defaults)
        raise Taken

    for package in (titanlite.commands, titanlite.tools):
        for info in pkgutil.iter_modules(package.__path__):
            if info.name in PROCESS_MODULES:
                continue
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            if getattr(module, "take_options", None) is command_line.take_options:
                monkeypatch.setattr(module, "take_options", take)
    monkeypatch.chdir(tmp_path)
    try:  # a config that is not there: a command that takes no options stops at it, one line, nothing written
        assert cli.main([*words, "--config", "missing.toml"]) == 2
    except Taken:
        pass
    assert list(tmp_path.iterdir()) == []
    return [f"--{name}" for name in seen]


def usage_lines(text: str) -> str:
    """A help's usage: its first line and the lines that continue it (`[--option ...]`), not the prose after."""
    lines = text.splitlines()
    kept = [lines[0]]
    for line in lines[1:]:
        if not line.strip().startswith("["):
            break
        kept.append(line)
    return "\n".join(kept)


def missing(options: list[str], usage: str) -> list[str]:
    return [o for o in options if not re.search(re.escape(o) + r"(?![\w-])", usage)]


@pytest.mark.parametrize("words", COMMANDS, ids=" ".join)
def test_every_option_a_command_takes_is_in_its_usage_lines(words, monkeypatch, tmp_path, capsys):
    options = parser_options(words, monkeypatch, tmp_path)
    assert options or words in (["seed-checkpoint"], ["analyze"]), "its take_options call was not seen"
    capsys.readouterr()
    assert cli.main([*words, "--help"]) == 0
    own = usage_lines(capsys.readouterr().out)
    assert own.startswith(f"usage: titanlite {' '.join(words)}"), own
    entry = usage_lines(cli.USAGE.split(f"\n  {' '.join(words)} ", 1)[1])  # its entry in `titanlite help`
    assert missing(options, own) == [], own
    assert missing(options, entry) == [], entry
