"""torchrun that ends a failed job with the failing worker's own line and exit status.

`python -m titanlite.commands.launch <torchrun options> -m titanlite.commands.train ...` (what run_train.sh,
`eval --ngpu`, `plan --measure`, `bench strategies` and the tests run) is torchrun, run in this process, with one
difference: torchrun ends a failed job with its multi-line summary and status 1 whatever the worker's
was. Here every worker records its failure (titanlite/base/failures.py) in a temporary folder; after a
failure the first one's line is printed last and its status (2 config, 3 non-finite loss, 4 out of
memory, 1 other) is this command's. A signal to the launcher ends it with 128 + the signal number;
torchrun's own failure (a rendezvous that cannot connect) is one line and status 1.

`--check` first (what run_train.sh passes) runs `titanlite check` for the job in this process before torchrun
starts: the world size is torchrun's processes per node times its (largest) node count. One interpreter and
one import of torch fewer per launch than a check of its own (about 3 s here); a refusal is the same one
line and status 2, before any worker starts.

A training job (`-m titanlite.commands.train`) holds its run folder's lock (titanlite/components/run_lock.py)
from before the first worker starts until the last one ends, elastic restarts included: a second launch on
the same folder is one line and status 2.

A titanlite worker (`-m titanlite.commands.train` or `-m titanlite.commands.evaluate`) starts as a function in a
process forked from one server (multiprocessing's forkserver, torchrun's `--start-method`) that imported torch and
the worker's module once, where torchrun would start a new interpreter per rank that imports them again: a launch
of 4 ranks on the 2-core test machine took 12.5 s of CPU against 27.7 s (one of 2: 12 s against 18 s). Elastic
restarts fork again from the same server. `--start-method spawn` gives each rank an interpreter of its own; any
other script or module runs as torchrun runs it.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import uuid
from pathlib import Path

import torch.distributed.run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import elastic_launch
from torch.multiprocessing import ProcessExitedException

from titanlite.base import logs
from titanlite.base.command_line import EVAL_WORKER, TRAIN_WORKER
from titanlite.base.errors import ConfigError
from titanlite.base.failures import FAILURE_DIR_ENV, PREFIX, first_failure, latest_failures
from titanlite.commands.worker import forked
from titanlite.components import run_lock
from titanlite.config import parse_config

CHECK = "--check"  # titanlite's own first option, not torchrun's: check the training job before it launches


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logs.set_up()
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(without_exit_traceback)
    check_first = argv[:1] == [CHECK]
    argv = argv[1:] if check_first else argv
    try:
        if check_first:
            check_job(argv)
        lock = lock_run_folder(argv)
    except ConfigError as e:
        print(f"{PREFIX}{e}", file=sys.stderr, flush=True)
        return 2
    try:
        return run(argv)
    finally:
        if lock is not None:
            lock.release()


def training_args(argv: list[str]) -> list[str] | None:
    """The worker's arguments of a training job (`... -m titanlite.commands.train ARGS`), else None."""
    if "-m" not in argv or argv[argv.index("-m") + 1 : argv.index("-m") + 2] != [TRAIN_WORKER]:
        return None
    return argv[argv.index("-m") + 2 :]


def check_job(argv: list[str]) -> None:
    """`titanlite check --world-size N --nproc-per-node K` of the training job that `argv` launches."""
    from titanlite.commands.check import check  # lazy: the tools that launch without --check do not pay for it

    args = training_args(argv)
    if args is None:
        raise ConfigError(f"{CHECK} checks a training job; give it '-m {TRAIN_WORKER}' and the run's arguments")
    options = torchrun.parse_args(argv)
    per_node = int(options.nproc_per_node)
    nodes = int(str(options.nnodes).rpartition(":")[2])  # N, or MIN:MAX for an elastic job
    check(["--world-size", str(per_node * nodes), "--nproc-per-node", str(per_node), *args])


def lock_run_folder(argv: list[str]) -> run_lock.RunLock | None:
    """The run folder's lock for a training job, shared by the launchers of one multi-node job; None for
    other modules (eval reads a run folder, it does not write one)."""
    args = training_args(argv)
    if args is None:
        return None
    cfg = parse_config(args)
    return run_lock.acquire(Path(cfg.job.dump_folder) / cfg.job.name, job_id(argv))


def job_id(argv: list[str]) -> str:
    """The rendezvous of a multi-node job (the same on each of its nodes), else one of this launcher alone."""
    options = {}
    for i, arg in enumerate(argv):
        if arg == "-m":
            break
        key, eq, value = arg.partition("=")
        options[key.replace("_", "-")] = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
    if "--rdzv-endpoint" in options and "--standalone" not in options:
        return f"rendezvous {options.get('--rdzv-id', 'none')} at {options['--rdzv-endpoint']}"
    return f"launcher {os.getpid()}"


def run(argv: list[str]) -> int:
    folder = Path(tempfile.mkdtemp(prefix="titanlite-failures-"))
    previous = os.environ.get(FAILURE_DIR_ENV)
    os.environ[FAILURE_DIR_ENV] = str(folder)  # the workers inherit it
    try:
        start(argv)
        return 0
    except ChildFailedError as error:
        return report(folder, error)
    except SignalException as e:
        return 128 + int(e.sigval)
    except Exception as e:  # torchrun itself failed (rendezvous, arguments): one line, not its traceback
        print(f"{PREFIX}torchrun could not run the job: {chain(e)}", file=sys.stderr, flush=True)
        return 1
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if previous is None:  # a caller in this process (a test, a tool) does not keep a folder that is gone
            os.environ.pop(FAILURE_DIR_ENV, None)
        else:
            os.environ[FAILURE_DIR_ENV] = previous


FORKED_WORKERS = (TRAIN_WORKER, EVAL_WORKER)
FORK_SERVER = "titanlite.commands.fork_server"  # imported first in the server: it ends with this launcher


def without_exit_traceback(record: logging.LogRecord) -> bool:
    """torchrun logs a forked worker's exit ('failed (exitcode: 1) local_rank: 1 ...') with the traceback of its
    own ProcessExitedException, which says nothing more than that line: the line is kept without it."""
    if record.exc_info and isinstance(record.exc_info[1], ProcessExitedException):
        record.exc_info = record.exc_text = None
    return True


def start(argv: list[str]) -> None:
    """torchrun's run(): titanlite's workers as functions forked from one server (see the module's docstring),
    anything else as torchrun starts it."""
    args = torchrun.parse_args(argv)
    module = args.training_script if args.module and not args.no_python else None
    if module not in FORKED_WORKERS:
        torchrun.run(args)
        return
    if not any(a.split("=")[0] in ("--start-method", "--start_method") for a in argv[: argv.index(module)]):
        args.start_method = "forkserver"
    # The rendezvous defaults of torchrun's run(): a standalone job, or one node without an endpoint, rendezvous
    # on a free local port.
    if args.standalone or (
        args.rdzv_backend == "static"
        and not args.rdzv_endpoint
        and args.master_port is None
        and torchrun.parse_min_max_nnodes(args.nnodes)[1] == 1
    ):
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    config, _, _ = torchrun.config_from_args(args)
    multiprocessing.set_forkserver_preload([FORK_SERVER, module])
    elastic_launch(config=config, entrypoint=forked)(module, dict(os.environ), list(args.training_script_args))


# Signals a worker's own native code raises; faulthandler (titanlite/commands/worker.py) prints its stacks.
NATIVE_CRASHES = {signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGABRT}


def chain(e: BaseException | None) -> str:
    """'Type: message' of an exception and of the exceptions it was raised from (the rendezvous errors
    keep their reason, e.g. a host name that does not resolve, in __cause__)."""
    parts: list[str] = []
    while e is not None and len(parts) < 3:
        message = " ".join(str(e).split())[:200]
        parts.append(f"{type(e).__name__}{': ' + message if message else ''}")
        e = e.__cause__ or e.__context__
    return "; from ".join(parts)


def report(folder: Path, error) -> int:
    """Print the root cause last; returns the exit status for it. A rank's own failure comes first; then a rank
    killed without a word (its peers' collectives then fail with a lost connection, which is not the cause);
    then whatever was recorded; then torchrun's view of the first exit."""
    first = first_failure(folder)
    if first is not None and not first.get("peer_lost"):
        print(first["line"], file=sys.stderr, flush=True)
        return first["code"]
    recorded = {e["rank"] for e in latest_failures(folder)}
    killed = {r: f for r, f in error.failures.items() if f.exitcode < 0 and r not in recorded}
    if first is not None and not killed:
        print(first["line"], file=sys.stderr, flush=True)
        return first["code"]
    if killed:  # the earliest death the agent saw; SIGTERM last, as the agent sends it when it stops the others
        rank, failure = min(killed.items(), key=lambda i: (i[1].exitcode == -signal.SIGTERM, i[1].timestamp, i[0]))
    else:  # no worker said why: it was killed, or died in C
        rank, failure = error.get_first_failure()
    code = failure.exitcode
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
        if -code in NATIVE_CRASHES:
            why = (
                f"crashed in native code ({name}): its Python stacks at the crash follow 'Fatal Python error' "
                "in the output above"
            )
        else:
            why = (
                f"killed by {name} without a reason (a kill, or the kernel's out-of-memory killer: see `dmesg`); "
                "torchrun's log above has its last output"
            )
        print(f"{PREFIX}rank {rank}: {why}", file=sys.stderr, flush=True)
        return 128 - code
    print(
        f"{PREFIX}rank {rank}: exited with status {code} before titanlite could say why (see its output above)",
        file=sys.stderr,
        flush=True,
    )
    return code or 1


if __name__ == "__main__":
    sys.exit(main())
