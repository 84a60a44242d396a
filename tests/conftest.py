import copy
import os

import pytest
import torch

from tests.helpers import metrics, train_in_pool
from tests.pool import close_pools

# Every test computes on the CPU with gloo, whatever GPUs the machine has (titanlite/base/devices.py), so the
# suite behaves the same on a laptop, a CPU CI box and a GPU server; tests marked `gpu` ask for CUDA
# themselves (TITANLITE_DEVICE=cuda in their runs' environment).
os.environ["TITANLITE_DEVICE"] = "cpu"


def pytest_collection_modifyitems(config, items):
    """`gpu` tests run wherever torch sees a CUDA GPU and are skipped, with the reason, elsewhere."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; torch sees none here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def token_cache(tmp_path_factory):
    """One store cache for the whole session, so the built-in corpus is tokenised once."""
    path = os.environ.get("TITANLITE_CACHE_DIR") or str(tmp_path_factory.mktemp("token_cache"))
    os.environ["TITANLITE_CACHE_DIR"] = path
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


def pytest_sessionfinish(session, exitstatus):
    close_pools()
