"""Falcon-H1 on real layouts (gloo, fp32, block-causal short documents, so every window crosses documents and documents
cross the ranks' chunks): its debug model (attention and a Mamba-2 mixer side by side on one norm in every layer,
then a SwiGLU MLP, every multiplier off one) gives one process's losses, grad norms and validation losses on TP x 2
(the attention by heads, the Mamba mixer by heads and groups, the MLP by its width, each of the block's two mixers
gathering the sequence itself), FSDP x 2, CP x 2 (the attention's keys gathered, the Mamba scan's chunk transitions
scanned in order) and PP x 2 (the last stage's final norm carrying the logits' multiplier). All run with the slow
tests (CI)."""

import pytest

from tests.distributed.test_context_parallel import (
    cp,
    short_documents,  # noqa: F401 (the fixture `documents` asks for)
)
from tests.distributed.test_model_families import BANNERS, LAYOUTS
from tests.helpers import assert_matches, metrics, train_in_pool

pytestmark = pytest.mark.distributed

CONFIG = ["--config", "train_configs/falcon_h1_debug.toml"]
ONE = ["--training.local_batch_size", "8"]  # the global batch of 8 on one process
RUNS = {**LAYOUTS, "cp2": (2, cp(2))}


@pytest.fixture(scope="module")
def whole(one_process, short_documents) -> list[dict]:  # noqa: F811
    """One process over the global batch of 8, block-causal short documents (once per pytest run)."""
    return one_process([*CONFIG, *short_documents, *ONE])


@pytest.mark.parametrize(
    "layout",
    # all with the slow tests (CI): the Mamba layers' TP split runs in the default suite as Granite 4.0 H's
    [pytest.param(layout, marks=pytest.mark.slow) for layout in ("tp2", "fsdp2", "cp2", "pp2")],
)
def test_falcon_h1_on_a_layout_matches_one_process(tmp_path, whole, short_documents, layout):  # noqa: F811
    nproc, args = RUNS[layout]
    proc = train_in_pool(nproc, [*CONFIG, *short_documents, *args], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "model falcon_h1 debug" in proc.stdout and f"layout: {BANNERS[layout]} on 2 cpu" in proc.stdout
    assert_matches(metrics(tmp_path), whole)
