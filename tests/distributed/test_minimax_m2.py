"""MiniMax-M2's debug model (gloo, fp32: whole-projection Q/K norms, half of each head rotated, 8 sigmoid-routed
experts on every layer, balanced by routing biases that move) on FSDP x 2, TP x 2 (the whole-projection norms split
with the heads, their sum of squares all-reduced; the MoE blocks whole on each rank), EP x 2, PP x 2 and CP x 2 gives
one process's losses, grad norms, validation losses and expert loads for the global batch of 8; a folder imports on
TP x 2 and EP x 2 with transformers' logits. PP x 2 (1F1B, two stages) runs it as 8 micro-batches of 1 and compares
with the one batch of 8 exactly: the bias method adds no per-micro-batch term, and the biases move by the step's
counts over every micro-batch. CP x 2 (causal, and block-causal on short documents): each rank holds 2 chunks of 8
tokens of each sequence, rotated at their true positions."""

import pytest
import torch

from tests.distributed.test_context_parallel import (
    cp,
    short_documents,  # noqa: F401 (the fixture `documents` asks for)
)
from tests.distributed.test_expert_parallel import assert_same_run
from tests.distributed.test_model_families import BANNERS, LAYOUTS
from tests.helpers import VALIDATED, metrics, train_in_pool

pytestmark = pytest.mark.distributed

# A rate at which the routing biases move enough within the 5 steps to change which experts are chosen.
MINIMAX = ["--config", "train_configs/minimax_m2_debug.toml", *VALIDATED, "--moe.bias_update_rate", "0.01"]
EP2 = (2, ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "4"])
CP2 = (2, cp(2))  # each rank 2 chunks of 8 of each sequence, the keys and values gathered


@pytest.fixture(scope="module")
def one(one_process) -> list[dict]:
    return one_process([*MINIMAX, "--training.local_batch_size", "8"])


@pytest.mark.slow  # five 2-rank runs beside the one-process reference, about 25 s alone: CI runs them
@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "ep2", "pp2", "cp2"])
def test_minimax_m2_on_a_layout_matches_one_process(tmp_path, one, layout):
    nproc, args = {"ep2": EP2, "cp2": CP2, **LAYOUTS}[layout]
    proc = train_in_pool(nproc, [*MINIMAX, *args], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "model minimax_m2 debug" in proc.stdout
    assert f"layout: {BANNERS[layout]} on 2 cpu" in proc.stdout
    assert "aux_load_balance" not in one[0]  # balanced by the routing biases
    assert_same_run(metrics(tmp_path), one)


@pytest.fixture(scope="module")
def documents(request) -> list[str]:
    """test_context_parallel's corpus of short documents (3 to 40 words) and validation on its tail."""
    return request.getfixturevalue("short_documents")


@pytest.mark.slow  # a 2-rank run and its one-process reference, about 7 s: CI runs them
def test_minimax_m2_on_block_causal_context_parallelism_matches_one_process(tmp_path, one_process, documents):
    """Each query sees only the keys of its own document, wherever in the sequence the other rank holds them."""
    run = ["--config", "train_configs/minimax_m2_debug.toml", *documents, "--model.attn_mask_type", "block_causal"]
    run += ["--moe.bias_update_rate", "0.01"]
    nproc, args = CP2
    proc = train_in_pool(nproc, [*run, *args], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "layout: cp 2 on 2 cpu" in proc.stdout
    assert_same_run(metrics(tmp_path), one_process([*run, "--training.local_batch_size", "8"]))


@pytest.mark.slow  # two 2-rank imports, about 10 s: CI runs them
@pytest.mark.parametrize("layout", ["tp2", "ep2"])
def test_a_minimax_m2_folder_imports_on_a_layout_with_transformers_logits(tmp_path, layout):
    """TP x 2 (each rank's heads of the projections and of the whole-projection norms' weights, their rotating rows
    reordered per head) or EP x 2 (experts stacked from their tensors and sharded): each rank reads the folder one
    tensor at a time, the routing biases too, and the forward gives transformers' logits."""
    pytest.importorskip("transformers")
    from tests.distributed.test_hf_layouts import layout_logits
    from tests.unit.test_hf_families import assert_logits_match
    from tests.unit.test_minimax_m2 import VOCAB, random_minimax

    hf = random_minimax()
    hf.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    tokens = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(4))
    ours = layout_logits(tmp_path / "hf", tokens, layout)
    with torch.no_grad():
        assert_logits_match(ours, hf(tokens).logits)
