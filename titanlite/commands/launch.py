"""torchrun that ends a failed job with the failing worker's own line and exit status.

`python -m titanlite.commands.launch <torchrun options> -m titanlite.commands.train ...` (what run_train.sh,
`eval --ngpu`, `plan --measure`, `bench strategies` and the tests run) is torchrun, run in this process, with one
difference: torchrun ends a failed job with its multi-line summary and status 1 whatever the worker's
was. Here every worker records its failure (titanlite/base/failures.py) in a temporary folder; after a
failure the first one's line is printed last (the workers of the last attempt leave it to this command: the line
once) and its status (2 config, 3 non-finite loss, 4 out of memory, 1 other) is this command's. A signal to the
launcher ends it with 128 + the signal number, after the line of a worker it stopped; torchrun's own failure is
one line and status 1.

A multi-node rendezvous that cannot form ends, in bounded time, before any worker starts, in one line and status 2:
the store at --rdzv-endpoint taken by another program, nothing answering there, or not every node joining within
the rendezvous's read_timeout / join_timeout (run_train.sh sets both from RDZV_TIMEOUT). torch's client bounds each
wait but one: a program at the port that accepts the connection and never answers holds it forever (torch 2.13), so
a watch (watch_store) connects to the store as torch's rendezvous does and ends the launch if that wait outlasts
read_timeout.

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

import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch.distributed.run as torchrun
from torch.distributed import TCPStore
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousTimeoutError
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.launcher.api import elastic_launch
from torch.multiprocessing import ProcessExitedException

from titanlite.base import logs
from titanlite.base.command_line import EVAL_WORKER, LAUNCH_ID_ENV, TRAIN_WORKER
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
        lock, made = lock_run_folder(argv)
    except ConfigError as e:
        print(f"{PREFIX}{e}", file=sys.stderr, flush=True)
        return 2

    def let_go() -> None:  # the lock, and the folders it made if the job left them empty (it never started)
        if lock is not None:
            lock.release()
            for folder in [lock.path.parent, *lock.path.parent.parents][: len(made)]:
                with contextlib.suppress(OSError):
                    folder.rmdir()

    try:
        return run(argv, release=let_go)
    finally:
        let_go()


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


def lock_run_folder(argv: list[str]) -> tuple[run_lock.RunLock | None, list[Path]]:
    """The run folder's lock for a training job, shared by the launchers of one multi-node job (None for other
    modules: eval reads a run folder, it does not write one), and the folders taking it made, innermost first."""
    args = training_args(argv)
    if args is None:
        return None, []
    cfg = parse_config(args)
    run_dir = Path(cfg.job.dump_folder) / cfg.job.name
    made = [folder for folder in (run_dir, *run_dir.parents) if not folder.exists()]
    return run_lock.acquire(run_dir, job_id(argv)), made


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


def run(argv: list[str], release: Callable[[], None] | None = None) -> int:
    """torchrun over `argv`; `release`: what to let go of (the run folder's lock) if the launch must end at once."""
    folder = Path(tempfile.mkdtemp(prefix="titanlite-failures-"))
    previous = os.environ.get(FAILURE_DIR_ENV)
    os.environ[FAILURE_DIR_ENV] = str(folder)  # the workers inherit it

    def stuck(line: str) -> None:  # the main thread waits in torch's C++ client: end the launch from here
        print(f"{PREFIX}{line}", file=sys.stderr, flush=True)
        shutil.rmtree(folder, ignore_errors=True)
        if release is not None:
            release()
        os._exit(2)

    rendezvous = rendezvous_store(argv)
    probe = None
    try:
        if rendezvous is not None and not rendezvous.hosts:
            probe = watch_store(rendezvous.endpoint, rendezvous.read_timeout, on_stuck=stuck)
        try:
            start(argv)
        finally:  # the watch ended long ago, or about when torch's own client failed (else stuck() ended the process)
            if probe is not None:
                probe.wait()
        return 0
    except ChildFailedError as error:
        return report(folder, error)
    except SignalException as e:  # torchrun stopped the workers: why they stopped, where they left it to this one
        stopped = first_failure(folder)
        if stopped is not None and stopped["attempt"] >= torchrun.parse_args(argv).max_restarts:
            print(stopped["line"], file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    except (RendezvousConnectionError, RendezvousTimeoutError) as e:  # the nodes could not meet: their settings
        where = rendezvous or Rendezvous("(torchrun's default)")
        print(f"{PREFIX}{rendezvous_failure(e, where)}", file=sys.stderr, flush=True)
        return 2
    except Exception as e:  # torchrun itself failed (rendezvous, arguments): one line, not its traceback
        print(f"{PREFIX}torchrun could not run the job: {chain(e)}", file=sys.stderr, flush=True)
        return 1
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if previous is None:  # a caller in this process (a test, a tool) does not keep a folder that is gone
            os.environ.pop(FAILURE_DIR_ENV, None)
        else:
            os.environ[FAILURE_DIR_ENV] = previous


# torch's defaults of a c10d rendezvous (c10d_rendezvous_backend, dynamic_rendezvous), where --rdzv-conf gives none.
READ_TIMEOUT, JOIN_TIMEOUT = 60, 600
# How long past read_timeout the watch waits before it asks whether torch's client is stuck (its last retry may end a
# few seconds late), and how long a second, short connection (STORE_PROBE_SECONDS) may take to end before the listener
# is called one that never answers: a store answers at once, a closed port refuses at once.
STUCK_GRACE_SECONDS = 3.0
STORE_PROBE_SECONDS, STORE_ANSWER_SECONDS = 1, 10.0
WHAT_TO_CHECK = (
    "start the node with NODE_RANK=0 (it hosts the store), check that RDZV_ENDPOINT is its address and port on "
    "every node and that a firewall lets the port through"
)


@dataclass(frozen=True)
class Rendezvous:
    """A c10d rendezvous at a given endpoint, with its timeouts in seconds (torchrun's --rdzv-conf)."""

    endpoint: str
    read_timeout: int = READ_TIMEOUT
    join_timeout: int = JOIN_TIMEOUT
    hosts: bool = False  # this node hosts the store (is_host): torch then never waits as a client


def rendezvous_store(argv: list[str]) -> Rendezvous | None:
    """The c10d rendezvous at a given endpoint that torchrun's options in `argv` ask for; None for a standalone job
    or another rendezvous backend."""
    try:
        args = torchrun.parse_args(argv)
    except SystemExit:  # torchrun reports its own usage errors when it runs
        return None
    if args.standalone or args.rdzv_backend != "c10d" or not args.rdzv_endpoint:
        return None
    conf = dict(item.split("=", 1) for item in args.rdzv_conf.split(",") if "=" in item)
    try:
        read, join = int(conf.get("read_timeout", READ_TIMEOUT)), int(conf.get("join_timeout", JOIN_TIMEOUT))
    except ValueError:
        return None  # torchrun refuses the value itself
    return Rendezvous(args.rdzv_endpoint, read, join, conf.get("is_host", "").lower() in ("1", "true", "yes", "y", "t"))


def watch_store(
    endpoint: str,
    timeout: int,
    on_stuck: Callable[[str], None],
    grace: float = STUCK_GRACE_SECONDS,
    answer: float = STORE_ANSWER_SECONDS,
) -> threading.Event:
    """Connect to the rendezvous store at `endpoint` as torch's c10d rendezvous does (a TCPStore client that waits up
    to `timeout` seconds), in a thread, and call `on_stuck` with the reason when that connection is stuck: still on
    `grace` seconds after its timeout, while a second, short connection gets no answer within `answer` seconds. That
    is a program at the port that accepts connections and never answers, for which torch's own client would wait
    forever. Nothing else is decided here: a refused or wrong answer ends torch's own client too, and run() reports
    it. Returns the event set when every connection of the watch has ended: the process must not exit while a thread
    is inside torch's client (its C++ code then aborts the interpreter's exit)."""
    host, port = parse_rendezvous_endpoint(endpoint, default_port=29400)
    done, settled = connect_store(host, port, timeout), threading.Event()

    def watch() -> None:
        if not done.wait(timeout + grace):
            while not done.is_set():  # past its timeout: retrying a closed port, or held by a silent listener
                if not connect_store(host, port, STORE_PROBE_SECONDS).wait(answer):
                    on_stuck(
                        f"RDZV_ENDPOINT={endpoint} accepted a connection but did not answer as a rendezvous store "
                        f"within {timeout} s: another program holds port {port} there; {WHAT_TO_CHECK}, or choose "
                        "a free port"
                    )
                    return
                done.wait(grace)
        settled.set()

    threading.Thread(target=watch, name="rendezvous-store-watch", daemon=True).start()
    return settled


def connect_store(host: str, port: int, timeout: float) -> threading.Event:
    """A TCPStore client's connection to host:port (torch's own handshake), in a daemon thread; the event is set when
    it has ended, answered or not."""
    done = threading.Event()

    def connect() -> None:
        try:
            TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout), multi_tenant=True)
        except Exception:  # whatever it met, torch's own rendezvous meets too and says
            pass
        finally:
            done.set()

    threading.Thread(target=connect, name="rendezvous-store-probe", daemon=True).start()
    return done


def rendezvous_failure(error: Exception, rendezvous: Rendezvous) -> str:
    """One line for a rendezvous that could not form: what happened at its endpoint and what to check."""
    reason, endpoint = chain(error), rendezvous.endpoint
    port = endpoint.rpartition(":")[2]
    if "EADDRINUSE" in reason or "address already in use" in reason.lower():
        return (
            f"this node hosts the rendezvous store at RDZV_ENDPOINT={endpoint} (NODE_RANK=0), but port {port} is in "
            "use by another program; stop it or choose a free port (the same RDZV_ENDPOINT on every node)"
        )
    if "Ping failed" in reason:
        return (
            f"RDZV_ENDPOINT={endpoint} answered, but not as a rendezvous store: another program holds port {port} "
            f"there; {WHAT_TO_CHECK}, or choose a free port"
        )
    if isinstance(error, RendezvousTimeoutError):
        return (
            f"the rendezvous at RDZV_ENDPOINT={endpoint} did not gather every node within {rendezvous.join_timeout} s "
            "(RDZV_TIMEOUT): start every node with the same NNODES, RDZV_ENDPOINT and RDZV_ID, or raise RDZV_TIMEOUT"
        )
    if "timed out" in reason or "Connection refused" in reason:
        return (
            f"nothing answered as a rendezvous store at RDZV_ENDPOINT={endpoint} within {rendezvous.read_timeout} s "
            f"(RDZV_TIMEOUT); {WHAT_TO_CHECK}"
        )
    return f"could not reach the rendezvous store at RDZV_ENDPOINT={endpoint} ({reason}); {WHAT_TO_CHECK}"


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
    # One id for this job's checkpoints, kept by its elastic restarts (titanlite/components/checkpoint.py lineage).
    os.environ.setdefault(LAUNCH_ID_ENV, uuid.uuid4().hex[:16])
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
