"""The command line below the entry points: a command's own `--name value` options, taken out of argv before the
rest is parsed as config overrides, and the entry points' module names, for the tools that start them as processes."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from titanlite.base.errors import ConfigError

# `python -m` names of the entry points (titanlite/commands/) that tools start as processes.
CLI = "titanlite.commands.cli"
LAUNCHER = "titanlite.commands.launch"  # torchrun with one-line failures; takes `-m WORKER` and its arguments
TRAIN_WORKER = "titanlite.commands.train"
EVAL_WORKER = "titanlite.commands.evaluate"
# The launcher's id for one job, the same in each of its elastic restarts: the lineage of the checkpoints it saves.
LAUNCH_ID_ENV = "TITANLITE_LAUNCH_ID"


def take_options(
    argv: list[str], defaults: dict[str, Any], command: str, at_least: dict[str, float] | None = None
) -> tuple[dict, list[str]]:
    """Pull a tool's `--name value` options out of argv, typed by their defaults (a bool default is a
    flag that takes no value); the rest of argv is config overrides. `command` prefixes errors. A number given
    must be finite (NaN and infinity are never a setting), and at least `at_least[name]` where that is set (a
    default below it, like -1 for "off", is the command's own and is not checked)."""
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
        kind = "a whole number" if isinstance(default, int) else "a number"
        try:
            values[name] = type(default)(value)
        except ValueError:
            raise ConfigError(f"{command} {key} takes {kind}, not '{value}'") from None
        number = values[name]
        if isinstance(number, float) and not math.isfinite(number):
            raise ConfigError(f"{command} {key} takes a finite number, not '{value}'")
        floor = (at_least or {}).get(name)
        if floor is not None and number < floor:
            raise ConfigError(f"{command} {key} must be at least {floor:g}, not {number:g}")
    return values, rest


def check_output_file(path: str, option: str) -> None:
    """Refuse, before any work, an output file (`option` names it, e.g. "eval --output") that could not be written:
    an existing folder, or a path under a file or an unwritable folder (missing folders are made when it is)."""
    if not path:
        return
    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"{option} {path} is a folder; name a file")
    check_writable_place(target.parent, f"{option} {path}")


def check_writable_place(folder: Path, what: str) -> None:
    """Refuse a folder that cannot be made and written (`what` starts the line): its nearest existing ancestor
    (itself, if it exists) must be a folder this process may write in."""
    ancestor = folder
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError(f"{what} is under {ancestor}, which is a file, not a folder; name another path")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConfigError(f"{what}: cannot write in {ancestor}; name a path in a folder you can write")
    kind = kernel_filesystem(ancestor)
    if kind:
        raise ConfigError(f"{what} is under {ancestor}, on the kernel's {kind} file system; name a path on a disk")


# File systems that the kernel makes up (devices, processes, its settings): nothing of a run's belongs there, though
# root may write some of them (/dev on devtmpfs). /dev/shm is tmpfs, a RAM disk, and allowed.
KERNEL_FILESYSTEMS = {"proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs"}


def kernel_filesystem(folder: Path) -> str:
    """The type of the kernel's file system that holds the existing `folder` (KERNEL_FILESYSTEMS), else "" (also
    where /proc/mounts cannot be read: not Linux)."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return ""
    resolved, best, kind = folder.resolve(), -1, ""
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = Path(fields[1].replace("\\040", " "))
        if (resolved == point or point in resolved.parents) and len(point.parts) > best:
            best, kind = len(point.parts), fields[2]
    return kind if kind in KERNEL_FILESYSTEMS else ""
