"""What every torchrun worker (train, eval) does around its body: parse the config, report a failure as one
line with its exit status (titanlite/base/failures.py), and leave without the abort at exit; and how the
launcher's forkserver starts one (`forked`)."""

from __future__ import annotations

import ctypes
import faulthandler
import importlib
import io
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from titanlite.base import logs
from titanlite.base.failures import record
from titanlite.config import JobConfig, parse_config, refuse_repeated_keys


def run_worker(
    body: Callable[[JobConfig], object], argv: list[str], parse: Callable[[list[str]], JobConfig] = parse_config
) -> int:
    """parse(argv), then body(cfg); returns the exit status, a failure being one line on stderr with
    the traceback in the run folder. A crash in native code (SIGSEGV, SIGABRT, ...) prints every thread's
    Python stack on stderr first (faulthandler), so the launcher's line can point at it."""
    faulthandler.enable(all_threads=True)
    logs.set_up(int(os.environ.get("RANK", 0)))
    cfg = None
    try:
        refuse_repeated_keys(argv)  # the user's command line, as `titanlite check` refuses it before launch
        cfg = parse(argv)
        body(cfg)
        return 0
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        run_dir = Path(cfg.job.dump_folder) / cfg.job.name if cfg is not None else None
        return record(e, int(os.environ.get("RANK", 0)), run_dir)


FAILED_EXIT_DELAY_S = 1.0  # see forked()

# This process's environment when it was imported: in the launcher's forkserver, the server's (see `forked`).
SERVER_ENV = dict(os.environ)


def die_with_launcher() -> None:
    """Under torchrun, end this worker at once if its launcher dies (SIGKILLed, or its node lost): an orphaned
    worker would otherwise train on beside the job that a new launch starts in the same run folder (Linux only;
    the launcher's lock is the only guard elsewhere). A forked worker's parent is the launcher's forkserver,
    which dies with the launcher in turn (titanlite/commands/fork_server.py)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent()


def die_with_parent() -> None:
    """SIGKILL this process when its parent process ends (Linux's PR_SET_PDEATHSIG; nothing elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6").prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the call above
        os._exit(128 + signal.SIGKILL)


def shutdown(code: int) -> None:
    """Leave without the abort at exit that DeviceMesh workers otherwise hit: torch.distributed on the CPU
    often ends a finished worker with SIGABRT ('terminate called without an active exception') at
    interpreter exit; a barrier, destroying the process group and os._exit after flushing avoid it."""
    leave_group(code)
    os._exit(code)


def leave_group(code: int) -> None:
    """The first half of `shutdown`: after a finished run a barrier, then destroy the process group; flush."""
    if dist.is_initialized():
        if code == 0:
            dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()


def exit_from(main: Callable[[], int]) -> None:
    """The `if __name__ == "__main__"` of a worker module: run it, show any escaped failure, then shutdown."""
    shutdown(status_of(main))


def status_of(main: Callable[[], int]) -> int:
    """main()'s exit status; an escaped failure is shown and is status 1 (leaving through the same clean exit)."""
    try:
        return main()
    except BaseException:
        traceback.print_exc()
        return 1


def forked(module: str, launcher_env: dict[str, str], argv: list[str]) -> None:
    """A worker started by the launcher's forkserver (titanlite/commands/launch.py): `python -u -m MODULE ARGV`,
    in a process forked from one that imported torch and MODULE once for every rank and restart. Its
    environment is the launcher's at this launch under torchrun's per-rank variables (RANK, MASTER_PORT, ...;
    the variables that differ from the server's, which may have started for an earlier launch of the same
    launcher process). A finished worker returns, which torchrun's agent waits for; any other status leaves
    at once with that status, as `shutdown` does."""
    for sig in (signal.SIGTERM, signal.SIGHUP):  # the server ignores them (fork_server.py); a worker must not
        signal.signal(sig, signal.SIG_DFL)
    per_rank = {key: value for key, value in os.environ.items() if SERVER_ENV.get(key) != value}
    os.environ.clear()
    os.environ.update(launcher_env)
    os.environ.update(per_rank)
    sys.argv = [module, *argv]
    for stream in (sys.stdout, sys.stderr):  # python -u, as torchrun runs a worker
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True, write_through=True)
    main = importlib.import_module(module).main
    code = status_of(lambda: main(argv))
    leave_group(code)
    if code:
        # torchrun's agent reports one failed forked rank, the first it finds dead at a poll (every 0.1 s): a rank that
        # died without a word (SIGKILL, the OOM killer) must be that one, not a peer that failed because it died,
        # for the launcher to name it (launch.py report); a failure this rank recorded is named whatever the order.
        time.sleep(FAILED_EXIT_DELAY_S)
        os._exit(code)
