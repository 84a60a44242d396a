import copy
import fcntl
import os
import subprocess

import pytest
import torch

from tests.helpers import VALIDATED, metrics, run_train_sh, titanlite_here, train_in_pool
from tests.pool import close_pools

# Every test computes on the CPU with gloo, whatever GPUs the machine has (titanlite/base/devices.py), so the
# suite behaves the same on a laptop, a CPU CI box and a GPU server; tests marked `gpu` ask for CUDA
# themselves (TITANLITE_DEVICE=cuda in their runs' environment).
os.environ["TITANLITE_DEVICE"] = "cpu"

# Under pytest-xdist each worker takes its share of the cores for torch's intra-op threads: torch's default is every
# core in every worker (12 workers on a 16-core GPU box ran about 190 threads). The pool's ranks and the runs started
# as processes use one thread each already (tests/pool.py, tests/helpers.py env).
if os.environ.get("PYTEST_XDIST_WORKER"):
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // _workers))


# The modules with the longest tests, longest first (the whole `.ci/run` on the 2-core machine, 2026-11-28: a
# documented block of four launches, `bench strategies`, the default run of 100 steps, the killed-worker restarts,
# the process-based saver on 4 ranks, 100 to 340 s each). They run first: pytest-xdist's worksteal hands each worker
# a contiguous share and the idle one takes the tail of the other's queue, so a long test last in the list ran with
# the other worker idle (minutes of one core on 2026-11-28). Every other module keeps its place after them.
LONGEST_FIRST = (
    "tests/test_doc_commands.py",
    "tests/test_bench.py",
    "tests/test_examples.py",
    "tests/distributed/test_resilience.py",
    "tests/distributed/test_checkpoint.py",
    "tests/distributed/test_context_parallel.py",
    "tests/distributed/test_plan_measure.py",
    "tests/distributed/test_run_folder_trust.py",
    "tests/distributed/test_validation.py",
    "tests/test_launcher.py",
)


def pytest_collection_modifyitems(config, items):
    """`gpu` tests run wherever torch sees a CUDA GPU and are skipped, with the reason, elsewhere; they run
    `alone` (below): a GPU test measures the GPU, which another test beside it would share. The modules of
    LONGEST_FIRST run first, each module's tests still together and in their order (module fixtures stay shared)."""
    cuda = torch.cuda.is_available()
    skip = pytest.mark.skip(reason="needs a CUDA GPU; torch sees none here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.alone if cuda else skip)
    rank = {module: i for i, module in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order


def shared_temp(tmp_path_factory):
    """The folder every pytest-xdist worker of this run shares (each has its own basetemp inside it); the
    basetemp itself without xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(autouse=True)
def one_beside_another(request, tmp_path_factory):
    """Under pytest-xdist (run_tests.sh runs two workers), a test marked `alone` runs with no test beside it:
    it waits for the other workers' current tests to end, and they wait for it (a readers-writer lock on
    files every worker shares; the turnstile keeps a waiting `alone` test from being passed by new readers).
    For the tests whose memory would not fit beside another's, or that measure time or a GPU."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    folder = shared_temp(tmp_path_factory)
    alone = request.node.get_closest_marker("alone") is not None
    with open(folder / "alone.turnstile", "a") as turnstile, open(folder / "alone.lock", "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if alone:  # keeps the turnstile until it ends: no other test starts meanwhile
            fcntl.flock(lock, fcntl.LOCK_EX)
        else:
            fcntl.flock(lock, fcntl.LOCK_SH)
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(turnstile, fcntl.LOCK_UN)


@pytest.fixture(scope="session", autouse=True)
def token_cache(tmp_path_factory):
    """One store cache for the whole session (shared by xdist's workers: the store builds under its own lock),
    so the built-in corpus is tokenised once."""
    path = os.environ.get("TITANLITE_CACHE_DIR") or str(shared_temp(tmp_path_factory) / "token_cache")
    os.makedirs(path, exist_ok=True)
    os.environ["TITANLITE_CACHE_DIR"] = path
    return path


@pytest.fixture(scope="session", autouse=True)
def datasets_cache(tmp_path_factory):
    """lm-eval's task documents (read through `datasets`) cached in the session's folder, not the user's home."""
    path = os.environ.get("HF_DATASETS_CACHE") or str(shared_temp(tmp_path_factory) / "datasets_cache")
    os.environ["HF_DATASETS_CACHE"] = path
    return path


@pytest.fixture(scope="session")
def one_process(tmp_path_factory):
    """one_process(args) -> the per-step records of one process training `args` (in the pool of one rank,
    tests/pool.py): run once per pytest run and shared by every test and module that asks for the same args."""
    cache: dict[tuple[str, ...], list[dict]] = {}

    def run(args: list[str]) -> list[dict]:
        key = tuple(args)
        if key not in cache:
            run_dir = tmp_path_factory.mktemp("one_process")
            train_in_pool(1, list(args), run_dir)
            cache[key] = metrics(run_dir)
        return copy.deepcopy(cache[key])

    return run


@pytest.fixture(scope="session")
def zero3_launch(tmp_path_factory):
    """(the CompletedProcess, the run folder's parent) of `NGPU=2 ./run_train.sh` on the default config, ZeRO-3 over 2
    fresh workers, validated: one launch that test_data_parallel.py compares with one process and test_pool.py with
    the same run in the pool (run once per pytest worker that asks)."""
    run_dir = tmp_path_factory.mktemp("zero3_launch")
    proc = run_train_sh([*VALIDATED, "--training.local_batch_size", "4"], run_dir, ngpu=2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc, run_dir


@pytest.fixture
def cli(monkeypatch):
    """cli(*argv, env={...}) -> CompletedProcess: tests/helpers.py titanlite_here (`titanlite ARGV` in this process,
    as the entry point runs it: its status and what it printed) with `env` set meanwhile. For the commands whose
    output a test reads (plan's figures, generate's ids, a check that passes) and the one-line refusals; a few
    refusals run as processes of their own, where the interpreter's exit is part of what is shown (docs/testing.md,
    the pool)."""

    def run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)
        return titanlite_here(*argv)

    return run


def pytest_sessionfinish(session, exitstatus):
    close_pools()
