"""The command line below the entry points: a command's own `--name value` options, taken out of argv before the
rest is parsed as config overrides, and the entry points' module names, for the tools that start them as processes
(`local_launch`: the command and environment, each process on run_train.sh's share of the cores)."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

from titanlite.base.errors import ConfigError, check_path_length

# `python -m` names of the entry points (titanlite/commands/) that tools start as processes.
CLI = "titanlite.commands.cli"
LAUNCHER = "titanlite.commands.launch"  # torchrun with one-line failures; takes `-m WORKER` and its arguments
TRAIN_WORKER = "titanlite.commands.train"
EVAL_WORKER = "titanlite.commands.evaluate"
# The launcher's id for one job, the same in each of its elastic restarts: the lineage of the checkpoints it saves.
LAUNCH_ID_ENV = "TITANLITE_LAUNCH_ID"


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's or a batch job's share), else the
    machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_per_process(processes: int) -> str:
    """OMP_NUM_THREADS for a launch of `processes` local processes, as run_train.sh sets it: the caller's where set,
    else the usable cores shared among the processes (at least 1 each)."""
    return os.environ.get("OMP_NUM_THREADS") or str(max(1, usable_cores() // processes))


def local_launch(
    processes: int, worker: str, args: list[str], log_dir: Path | None = None
) -> tuple[list[str], dict[str, str]]:
    """The command and environment that start `worker` (an entry point's module) with `args` on `processes` local
    processes through titanlite's launcher, as run_train.sh starts a run: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    (without it restarted gloo workers cannot reconnect on torch 2.13) and threads_per_process's threads."""
    cmd = [sys.executable, "-m", LAUNCHER, "--standalone", f"--nproc-per-node={processes}"]
    cmd += [f"--log-dir={log_dir}"] if log_dir is not None else []
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": threads_per_process(processes)}
    return [*cmd, "-m", worker, *args], env


def take_options(
    argv: list[str], defaults: dict[str, Any], command: str, at_least: dict[str, float] | None = None
) -> tuple[dict, list[str]]:
    """Pull a tool's `--name value` options out of argv, typed by their defaults (a bool default is a
    flag that takes no value); the rest of argv is config overrides. `command` prefixes errors. An option given
    twice is refused (which one was meant cannot be told). A number given must be finite (NaN and infinity are
    never a setting), and at least `at_least[name]` where that is set (a default below it, like -1 for "off", is
    the command's own and is not checked). A path option (PATH_OPTIONS) must be one a file system can hold."""
    values, rest, it = dict(defaults), [], iter(argv)
    given: dict[str, str] = {}
    for arg in it:
        key, has_inline, inline = arg.partition("=")
        name = key[2:]
        if not key.startswith("--") or name not in defaults:
            rest.append(arg)
            continue
        default = defaults[name]
        if isinstance(default, bool):
            if name in given:
                raise ConfigError(f"{command} {key} is given twice; give it once")
            given[name] = ""
            values[name] = True
            continue
        value = inline if has_inline else next(it, "")
        if name in given:
            raise ConfigError(f"{command} {key} is given twice ('{given[name]}', then '{value}'); give it once")
        given[name] = value
        if name in PATH_OPTIONS and value:
            check_path_length(value, f"{command} {key}")
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


def with_overrides(argv: list[str], changes: list[str]) -> list[str]:
    """The config overrides `argv` with `changes` (`--section.key VALUE`, `--section.key=VALUE` or a bare `--flag`) in
    place of any of the same keys: the command line of a run a command makes from the user's (a benchmark's jobs, a
    measured run), which sets some keys itself, since a key given twice on one command line is refused."""
    replaced = {key for key, _ in override_items(changes)}
    return [arg for key, args in override_items(argv) if key not in replaced for arg in args] + changes


def override_items(argv: list[str]) -> list[tuple[str, list[str]]]:
    """argv's overrides, each its key ('config' for --config) and its arguments, read as the config loader reads
    them (titanlite/config/loading.py): `--key=VALUE`; `--key VALUE`; a bare `--flag` when what follows is another
    option. An argument that is no option is an item of its own, with no key ('')."""
    items, i = [], 0
    while i < len(argv):
        arg = argv[i]
        key, eq, _ = arg[2:].partition("=")
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if not arg.startswith("--"):
            items.append(("", [arg]))
        elif eq or nxt is None or (nxt.startswith("--") and not is_number(nxt)):
            items.append((key, [arg]))
        else:
            items.append((key, [arg, nxt]))
            i += 1
        i += 1
    return items


def is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


# The commands' options that name a path (a file or folder they write).
PATH_OPTIONS = ("output", "keep")


def check_output_file(path: str, option: str) -> None:
    """Refuse, before any work, an output file (`option` names it, e.g. "eval --output") that could not be written:
    a path too long for the file system, an existing folder, or a path under a file or an unwritable folder
    (missing folders are made when it is written)."""
    if not path:
        return
    check_path_length(path, option)
    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"{option} {path} is a folder; name a file")
    check_writable_place(target.parent, f"{option} {path}")


def write_output(path: str | Path, text: str) -> None:
    """Write a command's output file, making its missing folders (check_output_file, before any work, refused a place
    where they could not be made): the result of minutes of work is never lost to a folder that was not there."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)


def check_writable_place(folder: Path, what: str) -> None:
    """Refuse a folder that cannot be made and written (`what` starts the line): a path too long for the file system,
    or one whose nearest existing ancestor (itself, if it exists) is not a folder this process may write in."""
    check_path_length(folder, what)
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
