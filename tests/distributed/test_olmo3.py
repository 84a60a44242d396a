"""OLMo 3 and OLMo 2 on real layouts (gloo, fp32): the debug models give one process's losses, grad norms and
validation losses on TP x 2, where each rank holds half the heads and the whole-projection Q/K norms all-reduce their
sums of squares (titanlite/models/common/parallelize.py WholeProjectionNorm), and OLMo 3's on FSDP x 2, PP x 2 and
CP x 2 (its sliding layers, and YaRN on its full layer only), causal and block-causal on short documents. OLMo
Hybrid's attention layers and OLMoE's take the same norms on TP x 2."""

import pytest

from tests.distributed.test_context_parallel import (
    cp,
    short_documents,  # noqa: F401 (the fixture `documents` asks for)
)
from tests.distributed.test_model_families import BANNERS, LAYOUTS
from tests.helpers import VALIDATED, assert_matches, metrics, train_in_pool

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

CONFIGS = {
    "olmo3": "train_configs/olmo3_debug.toml",
    "olmo2": "train_configs/olmo2_debug.toml",
    "olmo_hybrid": "train_configs/olmo_hybrid_debug.toml",
    "olmoe": "train_configs/olmoe_debug.toml",
}
# CP x 2: each rank holds 2 chunks of 8 of each sequence of 32, so the sliding layers' windows of 16 reach keys
# another rank computed.
ALL_LAYOUTS = {**LAYOUTS, "cp2": (2, cp(2))}


@pytest.mark.parametrize(
    "model, layout",
    [
        ("olmo3", "tp2"),
        ("olmo3", "fsdp2"),
        ("olmo3", "pp2"),
        ("olmo3", "cp2"),
        ("olmo2", "tp2"),
        ("olmo_hybrid", "tp2"),
        ("olmoe", "tp2"),
    ],
)
def test_an_olmo_on_a_layout_matches_one_process(tmp_path, one_process, model, layout):
    nproc, args = ALL_LAYOUTS[layout]
    run = ["--config", CONFIGS[model], *VALIDATED]
    proc = train_in_pool(nproc, [*run, *args], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert f"model {model} debug" in proc.stdout and f"layout: {BANNERS[layout]} on 2 cpu" in proc.stdout
    assert_matches(metrics(tmp_path), one_process([*run, "--training.local_batch_size", "8"]))


@pytest.fixture(scope="module")
def documents(request) -> list[str]:
    """test_context_parallel's corpus of short documents (3 to 40 words) and validation on its tail."""
    return request.getfixturevalue("short_documents")


def test_olmo3_on_block_causal_context_parallelism_matches_one_process(tmp_path, one_process, documents):
    """Each query sees the keys of its own document within its sliding window, wherever in the sequence they lie."""
    run = ["--config", CONFIGS["olmo3"], *documents, "--model.attn_mask_type", "block_causal"]
    nproc, args = ALL_LAYOUTS["cp2"]
    proc = train_in_pool(nproc, [*run, *args], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "layout: cp 2 on 2 cpu" in proc.stdout
    assert_matches(metrics(tmp_path), one_process([*run, "--training.local_batch_size", "8"]))
