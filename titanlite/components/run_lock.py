"""One job per run folder: a lock file, {run folder}/.lock, that the launcher holds for the whole job (elastic
restarts included), so that a second launch on the same folder stops with one line instead of interleaving
its checkpoints and metrics with the first's.

The lock names its holder: host, pid, job and start time, with the host's boot id and the process's start time
in clock ticks (/proc), so that a pid reused by an unrelated process after a container or node restart is not
taken for the job. It is written whole before it gets its name, so a crash never leaves it half-written. The
launchers of one multi-node job (the same rendezvous id and endpoint) share it; the one that made it removes it
at the end. A lock whose holder is gone (same host, and no such process, another boot, or a process that started
later under its pid: a launcher killed with SIGKILL) is taken over with a note, as is a torn one (an older
titanlite's). One on another host cannot be checked from here: the error says how to remove it when no job runs
there.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from titanlite.base.errors import ConfigError
from titanlite.base.failures import REFUSED, no_space, refused_access

LOCK_FILE = ".lock"

logger = logging.getLogger(__name__)


@dataclass
class RunLock:
    path: Path
    holder: dict
    mine: bool  # made by this process, so removed by it

    def release(self) -> None:
        """Remove the lock if this process made it and it still names this job. One that cannot be removed (its
        folder made read-only or unwritable during the run) is left with a note: its job is gone, so the next
        launch on the folder takes it over."""
        if self.mine and read_holder(self.path) == self.holder:
            try:
                self.path.unlink(missing_ok=True)
            except OSError as e:
                logger.warning(
                    f"titanlite: note: could not remove the run folder's lock {self.path} ({e.strerror or e}); the "
                    "next launch on this folder takes it over, its job being gone"
                )


def acquire(run_dir: Path, job: str) -> RunLock:
    """Take the run folder's lock for `job` (launchers of one multi-node job pass the same id and share it),
    making the folder if needed; ConfigError when another job holds it."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"cannot make the run folder {run_dir} ({e.strerror or e}); set job.dump_folder to a writable folder"
        ) from None
    try:
        return _acquire(run_dir, job)
    except OSError as e:  # a read-only, unreadable or full run folder
        raise ConfigError(folder_error(e, run_dir)) from None


def folder_error(e: OSError, run_dir: Path) -> str:
    """One line for an OSError of the run folder's (its lock's files are named by the folder): why, and what to
    change."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return no_space(run_dir)
    if e.errno in REFUSED:
        return refused_access(OSError(e.errno, e.strerror, str(run_dir)), run_dir)
    return f"cannot use the run folder {run_dir}: {e.strerror or e}; set job.dump_folder to a usable folder"


def _acquire(run_dir: Path, job: str) -> RunLock:
    host = socket.gethostname()
    me = {"host": host, "pid": os.getpid(), "job": job, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    me |= {key: value for key, value in process_identity(os.getpid()).items() if value is not None}
    path = run_dir / LOCK_FILE
    with _serialised(run_dir):  # one launcher of this host at a time reads, takes over and makes the lock
        while True:
            if _create(path, me):
                return RunLock(path, me, mine=True)
            holder = read_holder(path, wait=1.0)
            if not holder and _torn(path):
                # Written whole before it gets its name (_create): a lock that is not a whole record was left
                # by an older titanlite that died while writing it, or by a damaged disk. Nobody holds it.
                logger.warning(f"titanlite: note: {path} is not a whole lock record (a torn write); taking it over")
                path.unlink(missing_ok=True)
                continue
            if holder.get("job") == job:
                return RunLock(path, holder, mine=False)
            gone = _gone(holder) if holder.get("host") == host else None
            if gone:
                logger.warning(
                    f"titanlite: note: {path} was left by a job that is gone (pid {holder.get('pid')}, started "
                    f"{holder.get('started', '?')}: {gone}); taking it over"
                )
                path.unlink(missing_ok=True)
                continue
            raise ConfigError(busy(run_dir, holder, host)) from None


def _create(path: Path, holder: dict) -> bool:
    """Make the lock holding `holder`, atomically: written in full under a name of its own, then linked to the
    lock's name (which fails if the lock exists), so no reader ever sees it half-written. False if it exists.
    On a file system without hard links, an exclusive create and one write."""
    text = json.dumps(holder)
    tmp = path.with_name(f"{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.link(tmp, path)
    except FileExistsError:
        return False
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
            raise
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(text)
    finally:
        tmp.unlink(missing_ok=True)
    return True


def _torn(path: Path) -> bool:
    """Whether the lock file exists but is not a whole holder record."""
    try:
        return not isinstance(json.loads(path.read_text()), dict)
    except FileNotFoundError:
        return False
    except ValueError:
        return True


def check_free(run_dir: Path) -> None:
    """ConfigError when a live job of this host holds the run folder: what `titanlite check` asks before a
    one-node launch, so that a second launch stops in its first second rather than after its own checks (by
    when the first job may be gone). Multi-node launchers share the lock, so only they take it."""
    path = run_dir / LOCK_FILE
    holder = read_holder(path, wait=1.0) if path.exists() else {}
    if holder and holder.get("host") == socket.gethostname() and not _gone(holder):
        raise ConfigError(busy(run_dir, holder, holder["host"]))


def busy(run_dir: Path, holder: dict, host: str) -> str:
    who = f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, since {holder.get('started', '?')}"
    remedy = "wait for it to end, or set job.name or job.dump_folder to another folder"
    path = run_dir / LOCK_FILE
    if holder.get("host") != host:
        remedy += f" (another host's job cannot be checked from here: if no job runs there any more, delete {path})"
    elif not isinstance(holder.get("pid"), int) or holder["pid"] <= 0:
        remedy += f" ({path} names no valid pid, so whether its job lives cannot be told: if none runs, delete it)"
    return f"the run folder {run_dir} is in use by another job ({who}); {remedy}"


def read_holder(path: Path, wait: float = 0.0) -> dict:
    """The lock's holder, {} when unreadable; waits up to `wait` s for a lock being written to be complete."""
    deadline = time.monotonic() + wait
    while True:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            if time.monotonic() >= deadline:
                return {}
            time.sleep(0.05)


def process_identity(pid: int) -> dict:
    """What tells process `pid` from a later one given the same pid: the boot it runs in and its start time (in
    clock ticks since boot, /proc/<pid>/stat's 22nd field); None for either where /proc cannot tell."""
    try:
        boot: str | None = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = None
    try:  # the command name, in parentheses, may hold spaces: the fields after it are split
        start: int | None = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        start = None
    return {"boot_id": boot, "pid_start": start}


def _gone(holder: dict) -> str:
    """Why the job that made a lock of this host is gone ('' while it may be alive): no process has its pid, the
    host restarted since (another boot id), or the pid now belongs to a process that started later (a pid
    reused after a container or node restart). A lock without a start time (an older titanlite's) has only its
    pid to go by."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return ""  # cannot tell: treat as held (busy() says why)
    now = process_identity(pid)
    if holder.get("boot_id") and now["boot_id"] and holder["boot_id"] != now["boot_id"]:
        return "the host has restarted since"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "no process has its pid"
    except PermissionError:  # another user's live process: its start time below still tells
        pass
    if holder.get("pid_start") is not None and now["pid_start"] is not None and holder["pid_start"] != now["pid_start"]:
        return f"pid {pid} now belongs to another process, started later"
    return ""


@contextmanager
def _serialised(run_dir: Path) -> Iterator[None]:
    fd = os.open(run_dir, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the flock
