"""A failed worker explains itself in one line, and its exit status says what kind of failure it was.

Worker side (`record`): the exception becomes one line (rank, what failed; for an unexpected exception
its type, message and the innermost titanlite file:line), printed to stderr; the full traceback goes to
<run folder>/logs/error-rank<R>.log, named in that line. Under a launcher the line is also written to
$TITANLITE_FAILURE_DIR/rank<R>.json, so the launcher (titanlite/commands/launch.py) can print it last, after
torchrun's own report, and exit with the worker's status:

  2  bad config or input (ConfigError)     3  non-finite loss (NonFiniteLoss)
  4  out of memory (torch.OutOfMemoryError) 1  anything else
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path

import torch

from titanlite.base.errors import ConfigError, NonFiniteLoss

FAILURE_DIR_ENV = "TITANLITE_FAILURE_DIR"
PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # .../titanlite
PREFIX = "titanlite: error: "


def explain(exc: BaseException) -> tuple[int, str, bool]:
    """(exit status, one-line reason, whether a traceback helps)."""
    if isinstance(exc, ConfigError):
        return 2, str(exc), False
    if isinstance(exc, NonFiniteLoss):
        return (
            3,
            (
                f"{exc}; stopping before any checkpoint of it is saved (the newest checkpoint predates it; "
                "resume with a lower optimizer.lr, or set training.skip_nonfinite_steps)"
            ),
            False,
        )
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
    message = " ".join(str(exc).split())[:300]
    return 1, f"{type(exc).__name__}{': ' + message if message else ''} ({where(exc)})", True


def where(exc: BaseException) -> str:
    """The innermost frame of the traceback inside titanlite (else the innermost one), as file:line."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if Path(f.filename).resolve().is_relative_to(PACKAGE_ROOT)]
    frame = (ours or frames or [None])[-1]
    if frame is None:
        return "no traceback"
    path = Path(frame.filename).resolve()
    shown = path.relative_to(PACKAGE_ROOT.parent) if path.is_relative_to(PACKAGE_ROOT.parent) else path
    return f"{shown}:{frame.lineno}"


def record(exc: BaseException, rank: int, run_dir: Path | None) -> int:
    """Report a worker's failure: one line on stderr (and for the launcher), the traceback in a log file
    of the run folder. Returns the exit status."""
    code, reason, with_traceback = explain(exc)
    line = f"{PREFIX}rank {rank}: {reason}"
    if with_traceback:
        log = write_traceback(exc, rank, run_dir)
        line += f"; traceback in {log}" if log else ""
        if not log:  # no run folder to put it in: the traceback goes to stderr, before the line
            traceback.print_exception(exc)
    sys.stderr.write(line + "\n")  # one write: ranks share the stream
    sys.stderr.flush()
    folder = os.environ.get(FAILURE_DIR_ENV)
    if folder:
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        entry = {"rank": rank, "code": code, "line": line, "time": time.time(), "attempt": attempt}
        target = Path(folder) / f"rank{rank}.json"
        target.with_suffix(".tmp").write_text(json.dumps(entry))
        target.with_suffix(".tmp").replace(target)
    return code


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


def first_failure(folder: Path) -> dict | None:
    """The root cause among the recorded failures: the earliest of the latest attempt (the others are
    usually peers that lost it, seconds later)."""
    entries = []
    for path in folder.glob("rank*.json"):
        try:
            entries.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    if not entries:
        return None
    latest = max(e["attempt"] for e in entries)
    return min((e for e in entries if e["attempt"] == latest), key=lambda e: e["time"])


def reason_in(output: str) -> str:
    """The last titanlite error line of a launched run's output (what a launcher printed last), for
    tools and tests that run workers and must say why they failed."""
    lines = [line for line in output.splitlines() if line.startswith(PREFIX)]
    if lines:
        return lines[-1]
    tail = [line for line in output.splitlines() if line.strip()][-3:]
    return " | ".join(tail) or "no output"
