"""Gemma 4 on real layouts (gloo, fp32): its debug model (sliding and full layers with wider full heads, keys equal
to values, proportional rotary, the last two layers reusing earlier layers' keys and values, the logit softcap) gives
one process's losses, grad norms and validation losses on FSDP x 2 and TP x 2; the mixture-of-experts debug model
(gemma4_moe: 8 experts beside each MLP) on EP x 2, load-balancing term and expert load included. (Per-layer
embeddings refuse tensor parallelism before launch, and pipeline stages at start-up: see docs/models.md.)"""

import pytest

from tests.distributed.test_expert_parallel import assert_same_run
from tests.distributed.test_model_families import LAYOUTS
from tests.helpers import VALIDATED, assert_matches, metrics, train_in_pool

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

GEMMA4 = ["--config", "train_configs/gemma4_debug.toml", *VALIDATED]
MOE = ["--config", "train_configs/gemma4_moe_debug.toml", *VALIDATED]


def train(nproc: int, args: list[str], run_dir) -> list[dict]:
    proc = train_in_pool(nproc, args, run_dir)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return metrics(run_dir)


@pytest.mark.parametrize("layout", ["fsdp2", "tp2"])
def test_gemma4_on_a_layout_matches_one_process(tmp_path, one_process, layout):
    nproc, args = LAYOUTS[layout]
    reference = one_process([*GEMMA4, "--training.local_batch_size", "8"])
    assert_matches(train(nproc, [*GEMMA4, *args], tmp_path), reference)


def test_gemma4_moe_on_expert_parallelism_matches_one_process(tmp_path):
    one = train(1, [*MOE, "--training.local_batch_size", "8"], tmp_path / "one")
    assert all(r["aux_load_balance"] > 0 for r in one)
    ep2 = ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "4"]
    assert_same_run(train(2, [*MOE, *ep2], tmp_path / "ep2"), one)
