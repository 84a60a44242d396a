import os

import pytest
import torch

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
