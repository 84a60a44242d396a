"""OLMo 3 and OLMo 2 on real layouts (gloo, fp32): the debug models give one process's losses, grad norms and
validation losses on TP x 2, where each rank holds half the heads and the whole-projection Q/K norms all-reduce their
sums of squares (titanlite/models/common/parallelize.py WholeProjectionNorm), and OLMo 3's on FSDP x 2 (its sliding
layers, and YaRN on its full layer only). OLMo Hybrid's attention layers and OLMoE's take the same norms on TP x 2."""

import pytest

from tests.distributed.test_model_families import LAYOUTS
from tests.helpers import VALIDATED, assert_matches, metrics, train_in_pool

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

CONFIGS = {
    "olmo3": "train_configs/olmo3_debug.toml",
    "olmo2": "train_configs/olmo2_debug.toml",
    "olmo_hybrid": "train_configs/olmo_hybrid_debug.toml",
    "olmoe": "train_configs/olmoe_debug.toml",
}


@pytest.mark.parametrize(
    "model, layout",
    [("olmo3", "tp2"), ("olmo3", "fsdp2"), ("olmo2", "tp2"), ("olmo_hybrid", "tp2"), ("olmoe", "tp2")],
)
def test_an_olmo_on_a_layout_matches_one_process(tmp_path, one_process, model, layout):
    nproc, args = LAYOUTS[layout]
    run = ["--config", CONFIGS[model], *VALIDATED]
    proc = train_in_pool(nproc, [*run, *args], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert f"model {model} debug" in proc.stdout
    assert_matches(metrics(tmp_path), one_process([*run, "--training.local_batch_size", "8"]))
