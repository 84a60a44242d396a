"""A failed worker explains itself in one line, and its exit status says what kind of failure it was.

Worker side (`record`): the exception becomes one line (rank, what failed; for an unexpected exception
its type, message and the innermost titanlite file:line); the full traceback goes to
<run folder>/logs/error-rank<R>.log, named in that line. Under a launcher the line is written to
$TITANLITE_FAILURE_DIR/rank<R>.json, and the launcher (titanlite/commands/launch.py) prints it last, after
torchrun's own report, and exits with the worker's status; the worker prints it to stderr itself only where no
launcher will (no launcher, its folder gone, or an attempt torchrun restarts after the failure). A rank whose
collective fails because another rank died (a lost connection, or a timeout after another rank's recorded failure)
says so, quoting that rank's reason ("rank 0: lost its peers after rank 1 failed (rank 1's error: ...); here:
..."); the launcher names the other.
A rank that stops answering without failing (stopped by SIGSTOP or a debugger, or hung before its step's
collectives) is named by the ranks whose collectives time out waiting for it: each rank marks its pid and the step
it is working on in $TITANLITE_FAILURE_DIR/alive-rank<R>.json (`mark_progress`), and a timed-out rank reads its
peers' marks and process states (`stalled_peers`; ranks launched on the same node only).

The exit statuses:

  2  bad config or input (ConfigError)     3  non-finite loss (NonFiniteLoss)
  4  out of memory (torch.OutOfMemoryError) 128 + N  stopped by signal N (Preempted)
  1  anything else, a full disk and DCP's own failures (CheckpointException) among them, each in one line
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import sys
import time
import traceback
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException

from titanlite.base.errors import ConfigError, NonFiniteLoss, Preempted, TooManySkippedSteps

FAILURE_DIR_ENV = "TITANLITE_FAILURE_DIR"
# What a rank's collective raises when a peer process has died: gloo's closed or reset connections, NCCL's
# report of a remote process gone. Such a failure follows from another rank's; the launcher blames that one.
PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote process exited",
    "Connection refused",
)
# What a collective raises when it waits too long (gloo's "Timed out waiting ...", NCCL's watchdog "timeout"): a
# consequence when another rank of the attempt has already failed, else a failure of its own (a hang).
TIMED_OUT = ("timed out", "timeout", "timing out")
# How long a rank that lost its peers waits for the failed rank's record to appear (it is written before that
# rank exits, so it is normally there already).
PEER_RECORD_WAIT_S = 1.0
PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # .../titanlite
PREFIX = "titanlite: error: "


def explain(exc: BaseException, run_dir: Path | None = None) -> tuple[int, str, bool]:
    """(exit status, one-line reason, whether a traceback helps)."""
    if isinstance(exc, ConfigError):
        return 2, str(exc), False
    if isinstance(exc, Preempted):
        return 128 + exc.signum, str(exc), False
    if disk_full(exc):
        return 1, f"{no_space(run_dir)} ({where(exc)})", True
    refused = next((e for e in causes(exc) if isinstance(e, OSError) and e.errno in REFUSED), None)
    if isinstance(refused, OSError):
        return 2, f"{refused_access(refused, run_dir)} ({where(exc)})", False
    if isinstance(exc, NonFiniteLoss):
        return (
            3,
            (
                f"{exc}; stopping before any checkpoint of it is saved (the newest checkpoint predates it; "
                "resume with a lower optimizer.lr, or set training.skip_nonfinite_steps)"
            ),
            False,
        )
    if isinstance(exc, TooManySkippedSteps):
        return 3, f"{exc}; stopping before anything past them is saved (resume with a lower optimizer.lr)", False
    if isinstance(exc, torch.OutOfMemoryError):
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else "out of memory"
        return (
            4,
            (
                f"out of device memory ({first}) at {where(exc)}; lower training.local_batch_size, set "
                "activation_checkpoint.mode = 'full', shard more (parallelism.data_parallel_shard_degree) "
                "or offload (training.enable_cpu_offload)"
            ),
            True,
        )
    if isinstance(exc, CheckpointException):  # its str() is every rank's whole traceback
        rank, (inner, _) = min(exc.failures.items())
        message = " ".join(str(inner).split())[:300]
        return (
            1,
            f"checkpoint: {type(inner).__name__}{': ' + message if message else ''} on rank {rank} ({where(exc)})",
            True,
        )
    message = " ".join(str(exc).split())[:300]
    return 1, f"{type(exc).__name__}{': ' + message if message else ''} ({where(exc)})", True


def causes(exc: BaseException) -> list[BaseException]:
    """The exception, those it was raised from, and (for DCP's CheckpointException) each rank's own error."""
    out: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or any(e is seen for seen in out):
            continue
        out.append(e)
        todo += [e.__cause__, e.__context__]
        if isinstance(e, CheckpointException):
            todo += [inner for inner, _ in e.failures.values()]
    return out


def disk_full(exc: BaseException) -> bool:
    """Whether a failure comes from a full disk: ENOSPC, or torch's stream writer's 'unexpected pos', which is how
    a short write of torch.save shows (that is what DCP raises when a checkpoint fills the disk)."""
    for e in causes(exc):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e) or "unexpected pos" in str(e):
            return True
    return False


# What the file system answers a process that may not write (or read) a path: a read-only mount, no permission.
REFUSED = (errno.EROFS, errno.EACCES, errno.EPERM)


def refused_access(e: OSError, run_dir: Path | None) -> str:
    """One line for an OSError of REFUSED: the path, why, and what to change (in the run folder: job.dump_folder)."""
    path = Path(e.filename) if e.filename else (run_dir or Path.cwd())
    why = "its file system is read-only" if e.errno == errno.EROFS else "permission denied"
    inside = run_dir is not None and (path == run_dir or run_dir in path.parents or path in run_dir.parents)
    if inside:
        change = "make it writable by this user, or set job.dump_folder to a folder on a writable disk"
    elif e.errno == errno.EROFS:
        change = "copy it to a writable disk, or point the setting that names it elsewhere"
    else:
        change = "give this user access to it"
    return f"cannot use {path}: {why}; {change}"


def no_space(run_dir: Path | None) -> str:
    """'the disk holding FOLDER ran out of space' and what to do. The free space is the disk's now, after a failed
    save removed its partial folder, so it is said as such."""
    folder = run_dir if run_dir is not None else Path.cwd()
    probe = next((p for p in (folder, *folder.parents) if p.exists()), Path("/"))
    usage = shutil.disk_usage(probe)
    return (
        f"the disk holding {folder} ran out of space ({usage.free / 2**20:,.0f} of {usage.total / 2**20:,.0f} MiB "
        "free now); "
        "free space there, or set job.dump_folder to a disk with room"
    )


def where(exc: BaseException) -> str:
    """The innermost frame of the traceback inside titanlite (else the innermost one), as file:line."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if Path(f.filename).resolve().is_relative_to(PACKAGE_ROOT)]
    found = ours or frames
    if not found:
        return "no traceback"
    frame = found[-1]
    path = Path(frame.filename).resolve()
    shown = path.relative_to(PACKAGE_ROOT.parent) if path.is_relative_to(PACKAGE_ROOT.parent) else path
    return f"{shown}:{frame.lineno}"


def record(exc: BaseException, rank: int, run_dir: Path | None) -> int:
    """Report a worker's failure: one line on stderr (and for the launcher), the traceback in a log file
    of the run folder. Returns the exit status. A failure that follows from another rank's (a lost peer, or a
    collective timeout after a peer failed) says so, with that rank's own reason when it recorded one."""
    code, reason, with_traceback = explain(exc, run_dir)
    folder = os.environ.get(FAILURE_DIR_ENV)
    attempt = attempt_number()
    # A failure titanlite names (a bad config, a non-finite loss, out of memory, a signal) is this rank's own.
    named = isinstance(exc, (ConfigError, NonFiniteLoss, Preempted, torch.OutOfMemoryError))
    lost = not named and peer_lost(exc)
    if lost or (not named and timed_out(exc)):
        cause = peer_failure(Path(folder), rank, attempt, PEER_RECORD_WAIT_S if lost else 0.0) if folder else None
        if lost or cause is not None:
            reason, lost = consequence(exc, cause), True
        elif folder and (stalled := stalled_peers(Path(folder), rank, attempt)):
            reason = f"timed out waiting for {'; '.join(stalled)}; here: {symptom(exc)} ({where(exc)})"
    line = f"{PREFIX}rank {rank}: {reason}"
    if with_traceback:
        log = write_traceback(exc, rank, run_dir)
        if log:
            line += f"; traceback in {log}"
        elif run_dir is not None and disk_full(exc):  # the log could not be written either: say so, once
            line += f"; no traceback log (no room in {run_dir})"
        else:  # no run folder to put it in: the traceback goes to stderr, before the line
            traceback.print_exception(exc)
    recorded = False
    if folder:
        entry = {
            "rank": rank,
            "code": code,
            "line": line,
            "reason": reason,
            "time": time.time(),
            "attempt": attempt,
            "peer_lost": lost,
        }
        target = Path(folder) / f"rank{rank}.json"
        try:
            target.with_suffix(".tmp").write_text(json.dumps(entry))
            target.with_suffix(".tmp").replace(target)
            recorded = True
        except OSError:  # the launcher's folder is gone (it ended first): the line below is the report
            pass
    if not (recorded and last_attempt()):  # else the launcher prints it, last: once, not twice
        # One write (ranks share the stream), and not through logging: the line must appear whatever its set-up.
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    return code


def last_attempt() -> bool:
    """Whether this torchrun worker runs its job's last attempt (no restart follows a failure: torchrun's
    TORCHELASTIC_MAX_RESTARTS used up), whose failure the launcher reports; False outside torchrun."""
    most = os.environ.get("TORCHELASTIC_MAX_RESTARTS")
    return most is not None and attempt_number() >= int(most)


def write_traceback(exc: BaseException, rank: int, run_dir: Path | None) -> Path | None:
    if run_dir is None:
        return None
    try:
        log = run_dir / "logs" / f"error-rank{rank}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        header = (
            f"rank {rank} on {socket.gethostname()}, pid {os.getpid()}, attempt "
            f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}, {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
        )
        log.write_text(header + "".join(traceback.format_exception(exc)))
        return log
    except OSError:
        return None


def peer_lost(exc: BaseException) -> bool:
    """Whether a failure is a collective's reaction to a peer process that died (PEER_LOST)."""
    return any(symptom in str(e) for e in causes(exc) for symptom in PEER_LOST)


def timed_out(exc: BaseException) -> bool:
    """Whether a failure is a wait that ran out of time (TIMED_OUT): a collective, a store or a barrier."""
    return any(symptom in str(e).lower() for e in causes(exc) for symptom in TIMED_OUT)


def peer_failure(folder: Path, rank: int, attempt: int, wait_s: float) -> dict | None:
    """The earliest failure of another rank of this attempt that is its own (not a lost peer), waiting up to
    `wait_s` for one to be recorded; None when no rank of this launcher recorded one (it was killed, or it ran
    on another node)."""
    deadline = time.monotonic() + wait_s
    while True:
        entries = [e for e in failures_in(folder) if e.get("attempt") == attempt and e.get("rank") != rank]
        own = sorted((e for e in entries if not e.get("peer_lost")), key=lambda e: e["time"])
        if own or time.monotonic() >= deadline:
            return own[0] if own else None
        time.sleep(0.05)


def mark_progress(step: int) -> None:
    """Under the launcher, record this rank's (RANK's) pid and the step it is working on (alive-rank<R>.json, replaced
    whole), so that a peer whose collective times out can tell which rank stopped answering. A few hundred
    microseconds, once a step; nothing without a launcher's folder."""
    folder = os.environ.get(FAILURE_DIR_ENV)
    if not folder:
        return
    rank = int(os.environ.get("RANK", 0))
    target = Path(folder) / f"alive-rank{rank}.json"
    entry = {"rank": rank, "pid": os.getpid(), "step": step, "time": time.time(), "attempt": attempt_number()}
    try:
        target.with_suffix(".tmp").write_text(json.dumps(entry))
        target.with_suffix(".tmp").replace(target)
    except OSError:  # the launcher's folder is gone: nobody is left to ask
        pass


def attempt_number() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def process_state(pid: int) -> str | None:
    """The one-letter state of a process in /proc/<pid>/stat (R, S, D, T stopped, t traced, Z), or None where
    it is gone or cannot be read (not Linux)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()[0]  # after "pid (command name) "


def stalled_peers(folder: Path, rank: int, attempt: int) -> list[str]:
    """The other ranks of this attempt (on this node) that stopped answering, each with why: its process is
    stopped (SIGSTOP, Ctrl-Z, a debugger), or it never began the step this rank is working on. Empty when
    every peer is running the same step (the hang is inside it) or nothing was marked."""
    marks = {}
    for path in folder.glob("alive-rank*.json"):
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if entry.get("attempt") == attempt:
            marks[entry["rank"]] = entry
    own = marks.get(rank, {}).get("step")
    found = []
    for peer, entry in sorted(marks.items()):
        if peer == rank:
            continue
        pid, step, age = entry["pid"], entry["step"], time.time() - entry["time"]
        if process_state(pid) in ("T", "t"):
            found.append(
                f"rank {peer}, which is stopped (process {pid} in state T: SIGSTOP, Ctrl-Z or a debugger; "
                f"`kill -CONT {pid}` lets it go on) on step {step}"
            )
        elif own is not None and step < own:
            found.append(
                f"rank {peer} (pid {pid}), which never began step {own}: its last mark, {age:.0f} s ago, is step "
                f"{step} (a hang outside the collectives: its data, a host-side loop or I/O)"
            )
    return found


def symptom(exc: BaseException) -> str:
    """What a lost peer or a timeout looked like here, short: gloo's 'Connection closed by peer [HOST]:PORT'
    without its source-file prefix and advice, or the exception's first line."""
    for e in causes(exc):
        text = " ".join(str(e).split())
        for known in PEER_LOST:
            if known in text:
                return text[text.index(known) :].split(". ")[0][:160]
    e = next((e for e in causes(exc) if any(s in str(e).lower() for s in TIMED_OUT)), exc)
    text = " ".join(str(e).split())
    if text.startswith("[") and "] " in text:  # gloo's "[/path/to/pair.cc:553] ..."
        text = text.split("] ", 1)[1]
    return f"{type(e).__name__}: {text[:160]}"


def consequence(exc: BaseException, cause: dict | None) -> str:
    """The reason of a rank that failed because another one did: that rank and its own reason first, then
    what this rank saw. Without a record of the other rank's, says only that one failed first."""
    here = f"here: {symptom(exc)} ({where(exc)})"
    if cause is None:
        return (
            "lost its peers after another rank failed first (that rank's line, or torchrun's report of its exit, "
            f"gives the cause); {here}"
        )
    other = cause["rank"]
    why = cause.get("reason") or cause["line"].removeprefix(PREFIX).removeprefix(f"rank {other}: ")
    why = why.split("; traceback in ")[0]
    return f"lost its peers after rank {other} failed (rank {other}'s error: {why}); {here}"


def failures_in(folder: Path) -> list[dict]:
    """Every failure recorded in a launcher's folder (rank<R>.json), unordered."""
    entries = []
    for path in folder.glob("rank*.json"):
        try:
            entries.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return entries


def latest_failures(folder: Path) -> list[dict]:
    """The recorded failures of the latest restart attempt, earliest first."""
    entries = failures_in(folder)
    latest = max((e["attempt"] for e in entries), default=0)
    return sorted((e for e in entries if e["attempt"] == latest), key=lambda e: e["time"])


def first_failure(folder: Path) -> dict | None:
    """The root cause among the recorded failures: the earliest of the latest attempt that is not a peer's
    reaction to another rank's death (the others are usually peers that lost it, seconds later)."""
    entries = latest_failures(folder)
    own = [e for e in entries if not e.get("peer_lost")]
    found = own or entries
    return found[0] if found else None


def reason_in(output: str) -> str:
    """The last titanlite error line of a launched run's output (what a launcher printed last), for
    tools and tests that run workers and must say why they failed."""
    lines = [line for line in output.splitlines() if line.startswith(PREFIX)]
    if lines:
        return lines[-1]
    tail = [line for line in output.splitlines() if line.strip()][-3:]
    return " | ".join(tail) or "no output"
