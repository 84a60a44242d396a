"""Gloo ranks that outlive a test: a pool of N processes, started once per pytest run, that runs test bodies in
the same processes, each body with a fresh process group, mesh, model and data.

A training run in the pool (`tests/helpers.py train_in_pool`) calls the worker's own `train(cfg)`
(titanlite/commands/train.py), so it runs what every torchrun worker of `./run_train.sh` runs, without paying
for starting N interpreters, importing torch and titanlite N times and tearing them down. What only a launch
shows (the launcher, restarts, kills, signals, locks, rendezvous, one-line errors) stays on real launches.

Each body gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT with a fresh port) on top of
the test process's own, and its rank's stdout and stderr. Afterwards every rank destroys its process groups,
resets torch.compile and the global switches a run may set, and gets back its environment and working folder.
Any failure fails the test with the failing ranks' tracebacks: an exception, a rank that died, or a body that
does not finish within its timeout (every rank's Python stack is then dumped into the message). After a
failure the pool is killed and the next body starts a fresh one, so one test's hang or crash never reaches
the next.

Why not torch's `MultiProcContinuousTest` (torch.testing._internal.common_distributed): it is a
`unittest.TestCase` (no pytest fixtures or parametrisation), keeps one process group and one world size per
class for every test (a run here creates and destroys its own, as `init_process_group` in the worker does),
skips the rest of the class after a failure instead of restarting, and it is a private module that changes
between the torch versions titanlite supports (2.11 to 2.13). This file is the small part of it we need.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import gc
import importlib
import io
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import get_context
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT = 180  # seconds for a pool's ranks to start (the fork server imports torch and titanlite first)
GRACE = 10  # seconds the other ranks get to finish after one rank failed, before the pool is killed


class PoolFailure(AssertionError):
    """A body failed, died or hung in the pool; the message holds each failing rank's traceback."""


@dataclass
class Ran:
    """What a body gave back, shaped like subprocess.CompletedProcess for the tests that read a launch's
    output: stdout is rank 0's followed by the other ranks' (which print only what every rank must say)."""

    values: list[Any]
    outs: list[str]
    errs: list[str]
    seconds: float
    returncode: int = 0
    stdout: str = field(init=False)
    stderr: str = field(init=False)

    def __post_init__(self) -> None:
        self.stdout = "".join(self.outs)
        self.stderr = "".join(self.errs)


class RankPool:
    """`world_size` gloo ranks waiting for bodies; `run(fn, *args)` calls fn(*args) on every rank."""

    def __init__(self, world_size: int, preload: str | None = "titanlite.commands.train") -> None:
        self.world_size = world_size
        self.preload = preload  # a module every rank imports once when it starts (what the bodies use)
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        self.folder = ""
        self.starts = 0  # how many times its processes were started (1 + restarts after failures)

    def log(self, rank: int) -> Path:
        return Path(self.folder) / f"rank{rank}.log"

    def start(self) -> None:
        ctx = _context()
        self.folder = tempfile.mkdtemp(prefix=f"titanlite-pool{self.world_size}-")
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_serve,
                args=(rank, self.world_size, child, str(self.log(rank)), self.preload),
                name=f"pool{self.world_size}-rank{rank}",
            )
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        self.starts += 1
        for rank, conn in enumerate(self.conns):
            if not conn.poll(START_TIMEOUT):
                self.kill()
                raise PoolFailure(f"pool of {self.world_size}: rank {rank} did not start within {START_TIMEOUT} s")
            try:
                conn.recv()
            except EOFError:
                tail = self.log(rank).read_text()[-3000:] if self.log(rank).exists() else "(no output)"
                self.kill()
                raise PoolFailure(f"pool of {self.world_size}: rank {rank} died while starting:\n{tail}") from None

    def run(self, fn: Callable[..., Any], *args: Any, env: dict[str, str] | None = None, timeout: float = 300) -> Ran:
        if not self.procs:
            self.start()
        offsets = [self.log(rank).stat().st_size for rank in range(self.world_size)]
        body_env = {**os.environ, **(env or {})}
        port = free_port()
        began = time.monotonic()
        for conn in self.conns:
            conn.send((fn, args, body_env, port))
        replies: dict[int, tuple] = {}
        failed_at = None
        deadline = began + timeout
        while len(replies) < self.world_size:
            limit = deadline if failed_at is None else min(deadline, failed_at + GRACE)
            pending = [r for r in range(self.world_size) if r not in replies]
            ready = wait([self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending],
                         timeout=max(0.0, limit - time.monotonic()))  # fmt: skip
            if not ready:
                break
            for rank in pending:
                conn, proc = self.conns[rank], self.procs[rank]
                if conn in ready or proc.sentinel in ready:
                    try:
                        replies[rank] = conn.recv()
                    except (EOFError, OSError):
                        proc.join(1)
                        replies[rank] = ("died", f"rank {rank} died (exit code {proc.exitcode})", "", "")
                    if replies[rank][0] != "ok" and failed_at is None:
                        failed_at = time.monotonic()
        seconds = time.monotonic() - began
        if len(replies) == self.world_size and all(reply[0] == "ok" for reply in replies.values()):
            ordered = [replies[r] for r in range(self.world_size)]
            return Ran([v for _, v, _, _ in ordered], [o for *_, o, _ in ordered], [e for *_, e in ordered], seconds)
        raise PoolFailure(self.failure(fn, replies, offsets, timed_out=failed_at is None, seconds=seconds))

    def failure(self, fn, replies: dict[int, tuple], offsets: list[int], timed_out: bool, seconds: float) -> str:
        """The failing ranks' tracebacks and output (or, for a hang, every rank's stack), then a fresh pool."""
        hung = [r for r in range(self.world_size) if r not in replies]
        for rank in hung:  # faulthandler in _serve dumps every thread's stack into the rank's log
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.procs[rank].pid, signal.SIGUSR1)
        if hung:
            time.sleep(1)
        name = getattr(fn, "__qualname__", repr(fn))
        lines = [f"{name} failed in the pool of {self.world_size} after {seconds:.1f} s"]
        if hung:
            lines[0] += f"; rank(s) {hung} did not finish" + (" within the timeout" if timed_out else "")
        for rank in range(self.world_size):
            reply = replies.get(rank)
            if reply is not None and reply[0] == "ok":
                continue
            log = self.log(rank).read_text(errors="replace")[offsets[rank] :]
            what = reply[1] if reply is not None else "(no reply: its stack is below)"
            out = (reply[2] + reply[3]) if reply is not None else ""
            lines.append(f"--- rank {rank}: {what}\n{out[-3000:]}{log[-6000:]}")
        self.kill()
        return "\n".join(lines)

    def kill(self) -> None:
        """End every rank at once (SIGKILL: a run's SIGTERM handler would only ask it to stop after a step)."""
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(5)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self.procs:
            proc.join(10)
        self.kill()


_POOLS: dict[tuple[int, str], RankPool] = {}
PRELOAD = ["torch", "titanlite.commands.train", "tests.pool"]


@functools.cache
def _context():
    """Ranks start as forks of one server process per pytest process (multiprocessing's forkserver) that imported
    torch and titanlite once: a fork that finds them imported starts in a fraction of a second, where a fresh
    interpreter importing them took about 5 s of CPU per rank on the 2-core machine. The server forks before any
    thread or process group exists in it, and each body still builds its own group, mesh, model and data."""
    ctx = get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def pool(world_size: int, kind: str = "") -> RankPool:
    """The pool of `world_size` ranks, started on first use and kept for the rest of the pytest run. `kind`: a pool of
    its own for bodies that load what the others should not share a process with (lm-eval's task and metric
    libraries: a rank that had scored tasks was seen to abort at a later run's profiler thread shutdown,
    'tcache_thread_shutdown(): unaligned tcache chunk detected'); close_pool ends it."""
    if (world_size, kind) not in _POOLS:
        _POOLS[(world_size, kind)] = RankPool(world_size)
    return _POOLS[(world_size, kind)]


def close_pool(world_size: int, kind: str = "") -> None:
    """End the pool of `world_size` ranks (of `kind`) now (the 8-rank pool: 8 idle interpreters hold about 5 GB)."""
    if (world_size, kind) in _POOLS:
        _POOLS.pop((world_size, kind)).close()


@atexit.register
def close_pools() -> None:
    for p in _POOLS.values():
        p.close()
    _POOLS.clear()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- inside a rank ----


def _serve(rank: int, world_size: int, conn: Connection, log_path: str, preload: str | None) -> None:
    """A rank's loop: run each body it is sent, reply with its value and output, until it is sent None."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    with contextlib.suppress(OSError, AttributeError):  # end with pytest, whatever ends it (Linux)
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    if preload:
        importlib.import_module(preload)

    os.chdir(REPO)
    conn.send("ready")
    while True:
        job = conn.recv()
        if job is None:
            break
        fn, args, env, port = job
        conn.send(_run_body(rank, world_size, fn, args, env, port))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run_body(rank: int, world_size: int, fn, args, env: dict[str, str], port: int) -> tuple:
    """fn(*args) as rank `rank` of a torchrun job of `world_size` ranks, then this rank as it was before."""
    import torch
    import torch.distributed as dist

    saved_env, saved_cwd, saved_flags = dict(os.environ), os.getcwd(), _torch_flags()
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            value = fn(*args)
        if dist.is_initialized():  # as the worker's shutdown does: every rank finished, then no groups left
            dist.barrier()
            dist.destroy_process_group()
        reply: tuple = ("ok", value, out.getvalue(), err.getvalue())
    except BaseException as e:  # the test's failure: its traceback goes back; the pool is then replaced
        reply = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}", out.getvalue(), err.getvalue())
    finally:
        torch._dynamo.reset()
        _set_torch_flags(saved_flags)
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        _give_back_freed_memory()
        _forget_meshes()
    return reply


def _forget_meshes() -> None:
    """Empty DTensor's sharding caches (the C++ dispatch's, and torch.distributed's functools caches). They key
    their plans by the mesh's shape and dimension names, not by its process groups: a plan cached in one body names
    the groups of a mesh that body destroyed, and the next body with an equal mesh would send its collectives to a
    group name that is gone (seen: 'Could not resolve the process group registered under the name 12') or, worse,
    that now names another group."""
    import torch

    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # the C++ dispatch's cache
    if clear_native is not None:
        clear_native()
    for obj in gc.get_objects():
        if isinstance(obj, functools._lru_cache_wrapper) and (getattr(obj, "__module__", "") or "").startswith(
            "torch.distributed"
        ):
            obj.cache_clear()


def _give_back_freed_memory() -> None:
    """Return the body's freed heap to the system. A run tells glibc to keep freed memory (titanlite/builder/
    runtime.py keep_freed_memory_on_cpu), right for one run per process; a rank that runs hundreds of them would
    otherwise stay at the largest one's peak, and 15 ranks at their peaks crowd out the tests that need memory."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _torch_flags() -> tuple:
    """The process-wide switches a run sets (titanlite/builder/runtime.py set_determinism), to put back after it."""
    import torch

    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_num_threads(),
        torch.get_default_dtype(),
        torch.is_grad_enabled(),
    )


def _set_torch_flags(flags: tuple) -> None:
    import torch

    deterministic, cudnn_det, benchmark, matmul_tf32, cudnn_tf32, threads, dtype, grad = flags
    torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.deterministic = cudnn_det
    torch.backends.cudnn.benchmark = benchmark
    torch.backends.cuda.matmul.allow_tf32 = matmul_tf32
    torch.backends.cudnn.allow_tf32 = cudnn_tf32
    torch.set_num_threads(threads)
    torch.set_default_dtype(dtype)
    torch.set_grad_enabled(grad)


def train_job(argv: list[str]) -> None:
    """A training run's body on this rank: what `python -m titanlite.commands.train ARGV` runs under torchrun
    (titanlite/commands/worker.py run_worker), its failure raised here rather than recorded as an exit status."""
    from titanlite.base import logs
    from titanlite.commands.train import train
    from titanlite.config import parse_config

    logs.set_up(int(os.environ["RANK"]))
    train(parse_config(argv))


def eval_job(argv: list[str]) -> int:
    """A `titanlite eval --ngpu N` worker's body on this rank: what `python -m titanlite.commands.evaluate ARGV` runs
    under torchrun (its options --output, --bootstrap-iters, --log-samples, then the config), its exit status."""
    from titanlite.commands.evaluate import main

    with contextlib.redirect_stderr(_WithFileno(sys.stderr, 2)):
        return main(argv)


def cli_job(argv: list[str]) -> int:
    """`titanlite ARGV` on this rank (titanlite/commands/cli.py main, as the `titanlite` entry point runs it): its
    exit status. A command that runs a worker here enables faulthandler on stderr, which needs a file descriptor:
    the body's captured stderr gets the rank's own (its log, where a crash's stacks then go)."""
    from titanlite.commands.cli import main

    with contextlib.redirect_stderr(_WithFileno(sys.stderr, 2)):
        return main(argv)


class _WithFileno:
    """`stream`, with fileno() answering `fd`."""

    def __init__(self, stream: Any, fd: int) -> None:
        self._stream, self._fd = stream, fd

    def fileno(self) -> int:
        return self._fd

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)
