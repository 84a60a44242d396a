"""DeepSeek-V3.2's sparse attention (gloo, fp32) on every layout gives one process's losses, grad norms and indexer
losses: FSDP x 2, TP x 2 (the latent attention split by heads, the indexer whole on each rank, the attention weights
it learns from summed over the ranks), EP x 2, PP x 2, CP x 2 and CP x 4 (what each token's keys are made of gathered,
then put back in position order and selected on each rank), causal and block-causal; a CP x 2 checkpoint resumes on
one process with the same losses. The debug model's indexer keeps 16 keys of the 32-token sequences, so every layer
reads a selection from the 17th query on.

Every run takes micro-batches of 2 sequences (a global batch of 8), as the one-process reference accumulates them."""

import shutil

import pytest
import torch

from tests.helpers import TINY, assert_close, assert_matches, checkpoint_tensors, metrics, train_in_pool

pytestmark = pytest.mark.distributed

RUN = [
    "--config",
    "train_configs/deepseek_v32_debug.toml",
    *TINY,
    "--training.global_batch_size",
    "8",
    "--training.local_batch_size",
    "2",
]
BLOCK_CAUSAL = ["--model.attn_mask_type", "block_causal"]
CHECKPOINTED = ["--checkpoint.enable", "--checkpoint.interval", "3"]
CP = "--parallelism.context_parallel_degree"
PP = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2"]
LAYOUTS = {
    "fsdp2": (2, []),
    "tp2": (2, ["--parallelism.tensor_parallel_degree", "2"]),
    "ep2": (2, ["--parallelism.expert_parallel_degree", "2"]),
    "pp2": (2, PP),
    "cp2": (2, [CP, "2"]),
    "ac_full": (1, ["--activation_checkpoint.mode", "full"]),
    "cp4": (4, [CP, "4"]),
    # combinations: the heads split and the keys gathered; the stages each sharded
    "tp2_cp2": (4, ["--parallelism.tensor_parallel_degree", "2", CP, "2"]),
    "fsdp2_pp2": (4, PP),
}


def train(nproc, args, run_dir):
    proc = train_in_pool(nproc, [*RUN, *args], run_dir)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def assert_same_run(records, reference):
    assert_matches(records, reference)
    assert_close([r["indexer_loss"] for r in records], [r["indexer_loss"] for r in reference], 1e-5)
    assert all(r["indexer_loss"] > 0 for r in records)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single")
    proc = train(1, [], run_dir)
    assert "each query reads the 16 keys its layer's indexer selects" in proc.stdout
    return run_dir


@pytest.fixture(scope="module")
def block_causal(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single_block_causal")
    train(1, BLOCK_CAUSAL, run_dir)
    return run_dir


@pytest.mark.slow  # nine runs on 1, 2 and 4 ranks, about 40 s: CI runs them
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_layout_gives_one_processs_losses_and_indexer_losses(tmp_path, reference, layout):
    nproc, args = LAYOUTS[layout]
    train(nproc, args, tmp_path)
    assert_same_run(metrics(tmp_path), metrics(reference))


@pytest.mark.slow  # a reference and two runs, about 12 s: CI runs them
@pytest.mark.parametrize("nproc", [2, 4])
def test_context_parallel_under_a_block_causal_mask_gives_one_processs_losses(tmp_path, block_causal, nproc):
    train(nproc, [*BLOCK_CAUSAL, CP, str(nproc)], tmp_path)
    assert_same_run(metrics(tmp_path), metrics(block_causal))


def test_a_cp2_checkpoint_resumes_on_one_process_with_the_same_losses(tmp_path):
    """CP x 2's step-3 checkpoint continues on one process as the CP x 2 run went on (CP x 2 and x 4 against one
    process: the slow tests above)."""
    straight = tmp_path / "cp2"
    train(2, [CP, "2", *CHECKPOINTED], straight)
    expected = metrics(straight)
    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "run").mkdir(parents=True)
    shutil.copytree(straight / "run" / "step-3", resumed_dir / "run" / "step-3")
    first = (straight / "run" / "metrics.jsonl").read_text().splitlines()[:3]
    (resumed_dir / "run" / "metrics.jsonl").write_text("\n".join(first) + "\n")
    proc = train(1, CHECKPOINTED, resumed_dir)
    assert "resumed from" in proc.stdout and "at step 3" in proc.stdout
    resumed = metrics(resumed_dir)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5]
    assert_close([r["loss"] for r in resumed[3:]], [r["loss"] for r in expected[3:]], 1e-5)
    assert_close([r["indexer_loss"] for r in resumed[3:]], [r["indexer_loss"] for r in expected[3:]], 1e-5)


@pytest.mark.slow  # two runs, about 10 s: CI runs them
def test_the_dense_warmup_trains_the_indexers_alone_and_fsdp_gives_one_processs(tmp_path):
    """training.indexer_dense_warmup: every weight but the indexers' frozen (FSDP shards them frozen), the attention
    dense; FSDP x 2 gives one process's losses and indexer losses, and between the step-3 and step-5 checkpoints only
    the indexers' weights (and their optimizer's moments) change."""
    warmup = ["--training.indexer_dense_warmup", "true", *CHECKPOINTED]
    proc = train(1, warmup, tmp_path / "single")
    assert "sparse attention: dense warm-up (training.indexer_dense_warmup)" in proc.stdout
    train(2, warmup, tmp_path / "fsdp2")
    assert_same_run(metrics(tmp_path / "fsdp2"), metrics(tmp_path / "single"))
    run = tmp_path / "fsdp2" / "run"
    before = checkpoint_tensors(run / "step-3", tmp_path / "a")
    after = checkpoint_tensors(run / "step-5", tmp_path / "b")
    weights = [name for name in after if name.startswith("model.")]
    moved = {name for name in weights if not torch.equal(before[name], after[name])}
    assert moved and all(".indexer." in name for name in moved), sorted(moved)
    assert {name for name in weights if ".indexer." in name} == moved
