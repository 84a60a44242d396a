import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def token_cache(tmp_path_factory):
    """One store cache for the whole session, so the built-in corpus is tokenised once."""
    path = os.environ.get("TITANLITE_CACHE_DIR") or str(tmp_path_factory.mktemp("token_cache"))
    os.environ["TITANLITE_CACHE_DIR"] = path
    return path
