"""Qwen3-MoE on FSDP x 2 (gloo, fp32) gives one process's losses, grad norms, validation losses and load-balancing
terms, and with the bias method its expert loads and routing biases. Each rank runs 4 of the global batch's 8
sequences as one micro-batch and the load-balancing statistics are summed over both ranks before the term is formed
(titanlite/parallel/parallelize.py pool_balance_over), so the term is that of one process running all 8."""

import pytest
import torch

from tests.helpers import TINY, VALIDATED, assert_close, assert_matches, checkpoint_tensors, metrics, train_in_pool

pytestmark = pytest.mark.distributed

MOE = ["--config", "train_configs/qwen3_moe_debug.toml", *VALIDATED, "--training.local_batch_size", "4"]


@pytest.mark.slow  # one run beside the shared one-process reference, about 10 s: CI runs it
def test_qwen3_moe_on_fsdp_matches_one_process(tmp_path, reference):
    fsdp = train_in_pool(2, MOE, tmp_path / "fsdp2")
    assert fsdp.returncode == 0, fsdp.stdout[-2000:] + fsdp.stderr[-4000:]
    assert "model qwen3_moe debug" in fsdp.stdout
    one, two = reference("qwen3_moe"), metrics(tmp_path / "fsdp2")
    assert_matches(two, one)
    assert_close([r["aux_load_balance"] for r in two], [r["aux_load_balance"] for r in one], 1e-5)


BIAS = [
    "--config",
    "train_configs/qwen3_moe_debug.toml",
    *TINY,
    "--training.local_batch_size",
    "4",
    "--moe.balance",
    "bias",
    "--moe.bias_update_rate",
    "0.01",
    "--checkpoint.enable",
    "true",
    "--checkpoint.interval",
    "5",
]


@pytest.mark.slow  # two runs, about 20 s: CI runs it
def test_the_bias_method_on_fsdp_matches_one_process_losses_and_biases(tmp_path):
    """Each rank routes its own 4 sequences; the biases move by the counts of all 8 (summed over the ranks), as
    one process accumulating the same two micro-batches moves them: the same losses, expert loads and biases."""
    single = train_in_pool(1, [*BIAS, "--training.global_batch_size", "8"], tmp_path / "single")
    assert single.returncode == 0, single.stderr[-3000:]
    fsdp = train_in_pool(2, BIAS, tmp_path / "fsdp2")
    assert fsdp.returncode == 0, fsdp.stdout[-2000:] + fsdp.stderr[-4000:]
    one, two = metrics(tmp_path / "single"), metrics(tmp_path / "fsdp2")
    assert_close([r["loss"] for r in two], [r["loss"] for r in one], 1e-5)
    assert [r["expert_load"] for r in two] == pytest.approx([r["expert_load"] for r in one], rel=1e-6)
    biases = [
        {k: v for k, v in checkpoint_tensors(tmp_path / run / "run/step-5", tmp_path / run).items() if "bias" in k}
        for run in ("single", "fsdp2")
    ]
    assert biases[0].keys() == biases[1].keys() and len(biases[0]) == 3
    for name, bias in biases[0].items():
        assert bias.abs().sum() > 0, name
        torch.testing.assert_close(biases[1][name], bias, rtol=0, atol=0)


@pytest.mark.slow  # two runs, about 20 s: CI runs it
def test_the_bias_method_on_a_pipeline_matches_one_process(tmp_path):
    """Each stage counts its own blocks' tokens and the worst block is taken over the stages; torch's shape
    inference forward before the first step is not counted (it would move step 1's biases otherwise)."""
    run = ["--config", "train_configs/qwen3_moe_debug.toml", *TINY, "--moe.balance", "bias"]
    run += ["--moe.bias_update_rate", "0.01"]
    single = train_in_pool(1, run, tmp_path / "single")
    assert single.returncode == 0, single.stderr[-3000:]
    pp = train_in_pool(2, [*run, "--parallelism.pipeline_parallel_degree", "2"], tmp_path / "pp2")
    assert pp.returncode == 0, pp.stdout[-2000:] + pp.stderr[-4000:]
    one, two = metrics(tmp_path / "single"), metrics(tmp_path / "pp2")
    assert_close([r["loss"] for r in two], [r["loss"] for r in one], 1e-5)
    assert [r["expert_load"] for r in two] == pytest.approx([r["expert_load"] for r in one], rel=1e-6)


def test_a_qwen3_moe_folder_imports_on_ep_and_fsdp_with_transformers_logits(tmp_path):
    """EP x 2 on 2 ranks (every other weight FSDP-sharded over both): each rank reads the experts' tensors one
    parameter at a time, stacks them and keeps its expert-parallel shard; the forward routes tokens across ranks."""
    from tests.conformance import assert_logits_match
    from tests.distributed.test_hf_layouts import layout_logits
    from tests.unit.test_qwen3_moe import VOCAB, random_model

    hf = random_model()
    hf.save_pretrained(tmp_path / "hf", max_shard_size="100KB")  # sharded files: read tensor by tensor
    tokens = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(4))
    ours = layout_logits(tmp_path / "hf", tokens, "ep2")
    with torch.no_grad():
        assert_logits_match(ours, hf(tokens).logits)
