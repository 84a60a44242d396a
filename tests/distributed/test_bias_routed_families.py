"""The families with DeepSeek-V3's sigmoid routing and a routing bias on real layouts (gloo, fp32): GLM-4.5's debug
model (QKV biases, per-head Q/K norms, partial rotary, a dense first layer, then 8 grouped experts with a shared one)
and MiniMax-M2's (whole-projection Q/K norms, half of each head rotated, 8 experts on every layer), their biases
moving, on FSDP x 2, TP x 2 (per-head norms split with their heads; whole-projection norms split too, their sum of
squares all-reduced; the MoE blocks whole on each rank), EP x 2, PP x 2 and CP x 2 give one process's losses, grad
norms, validation losses and expert loads for the global batch of 8. PP x 2 (1F1B, two stages) runs it as 8
micro-batches of 1 and compares with the one batch of 8 exactly: the bias method adds no per-micro-batch term, and the
biases move by the step's counts over every micro-batch. CP x 2 (causal, and block-causal on short documents): each
rank holds 2 chunks of 8 tokens of each sequence, rotated at their true positions. (MiniMax-M2's folder on TP x 2 and
EP x 2: tests/distributed/test_minimax_m2.py.)"""

import pytest

from tests.distributed.test_context_parallel import (
    cp,
    short_documents,  # noqa: F401 (the fixture `documents` asks for)
)
from tests.distributed.test_expert_parallel import assert_same_run
from tests.distributed.test_model_families import BANNERS, LAYOUTS
from tests.helpers import VALIDATED, metrics, train_in_pool

pytestmark = pytest.mark.distributed

FAMILIES = ("glm4_moe", "minimax_m2")
# A rate at which the routing biases move enough within the 5 steps to change which experts are chosen.
BIAS = ["--moe.bias_update_rate", "0.01"]
EP2 = (2, ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "4"])
CP2 = (2, cp(2))  # each rank 2 chunks of 8 of each sequence, the keys and values gathered


def config(family: str) -> list[str]:
    return ["--config", f"train_configs/{family}_debug.toml", *BIAS]


@pytest.mark.slow  # five 2-rank runs a family beside its one-process reference, about 25 s alone: CI runs them
@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "ep2", "pp2", "cp2"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_on_a_layout_matches_one_process(tmp_path, one_process, family, layout):
    run = [*config(family), *VALIDATED]
    one = one_process([*run, "--training.local_batch_size", "8"])
    nproc, args = {"ep2": EP2, "cp2": CP2, **LAYOUTS}[layout]
    proc = train_in_pool(nproc, [*run, *args], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert f"model {family} debug" in proc.stdout
    assert f"layout: {BANNERS[layout]} on 2 cpu" in proc.stdout
    assert "aux_load_balance" not in one[0]  # balanced by the routing biases
    assert_same_run(metrics(tmp_path), one)


@pytest.fixture(scope="module")
def documents(request) -> list[str]:
    """test_context_parallel's corpus of short documents (3 to 40 words) and validation on its tail."""
    return request.getfixturevalue("short_documents")


@pytest.mark.slow  # a 2-rank run and its one-process reference a family, about 7 s: CI runs them
@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_on_block_causal_context_parallelism_matches_one_process(tmp_path, one_process, documents, family):
    """Each query sees only the keys of its own document, wherever in the sequence the other rank holds them."""
    run = [*config(family), *documents, "--model.attn_mask_type", "block_causal"]
    nproc, args = CP2
    proc = train_in_pool(nproc, [*run, *args], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "layout: cp 2 on 2 cpu" in proc.stdout
    assert_same_run(metrics(tmp_path), one_process([*run, "--training.local_batch_size", "8"]))
