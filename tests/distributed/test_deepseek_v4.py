"""DeepSeek-V4 on real layouts (gloo, fp32, block-causal short documents, so every window of 32 tokens crosses
documents and documents cross the ranks' chunks): its debug model (two residual streams with hyper-connections; a
sliding layer, two CSA layers whose indexer picks 2 blocks of 2 tokens with its KL loss, an HCA layer of blocks of 4,
each with a window of 8 and sinks; experts with sqrt-softplus scores, clamped SwiGLUs, the first three layers routed by
their token tables, the last by its scores and routing biases moved by the step's counts) gives one process's losses,
grad norms, validation losses and expert loads on FSDP x 2, TP x 2 (attention split by heads, the streams sharded by
sequence), TP x 2 with the experts split over it (ETP), EP x 2, PP x 2 (the stage boundary after hash-routed layer 1;
stage 1's hash-routed layer 2 takes the token ids as a keyword), CP x 2 and CP x 4 (every rank's keys and
compressors' inputs gathered, the blocks made in sequence order), and the combinations TP x 2 with CP x 2 and FSDP x 2
with PP x 2; a CP x 2 checkpoint resumed on one process continues the uninterrupted losses."""

import pytest

from tests.distributed.test_context_parallel import (
    assert_cp2_checkpoint_resumes,
    cp,
    short_documents,  # noqa: F401 (the fixture `documents` asks for)
)
from tests.distributed.test_expert_parallel import EP2, assert_same_run
from tests.distributed.test_model_families import LAYOUTS
from tests.helpers import metrics, train_in_pool

pytestmark = pytest.mark.distributed

# with its multi-token prediction depth (a sliding layer over the streams, on the last pipeline stage)
CONFIG = ["--config", "train_configs/deepseek_v4_debug.toml", "--model.mtp_layers", "1"]
ONE = ["--training.local_batch_size", "8"]  # the global batch of 8 on one process
TP2 = LAYOUTS["tp2"][1]
LAYOUT_ARGS = {
    **LAYOUTS,
    "ep2": EP2,
    "etp2": (2, [*TP2, "--parallelism.expert_tensor_parallel_degree", "2"]),  # the experts split over TP too
    "cp2": (2, cp(2)),
    "cp4": (4, cp(4)),
    "tp2_cp2": (4, cp(2, tp=2)),  # the heads split over TP, the sequence over CP
    "fsdp2_pp2": (4, ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4"]),
}


@pytest.fixture(scope="module")
def whole(one_process, short_documents) -> list[dict]:  # noqa: F811
    """One process over the global batch of 8, block-causal short documents (once per pytest run)."""
    return one_process([*CONFIG, *short_documents, *ONE])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "etp2", "ep2", "pp2", "cp2", "cp4", "tp2_cp2", "fsdp2_pp2"])
def test_deepseek_v4_on_a_layout_matches_one_process(tmp_path, whole, short_documents, layout):  # noqa: F811
    nproc, args = LAYOUT_ARGS[layout]
    proc = train_in_pool(nproc, [*CONFIG, *short_documents, *args], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert layout != "ep2" or "ep 2 (of shard x cp)" in proc.stdout
    assert_same_run(metrics(tmp_path), whole)
    assert all(r["indexer_loss"] > 0 for r in whole)


@pytest.mark.slow  # a one-process reference, a 2-rank and a 1-rank run
def test_a_deepseek_v4_cp2_checkpoint_resumes_on_one_process_with_the_uninterrupted_losses(
    tmp_path,
    whole,
    short_documents,  # noqa: F811
):
    """CP x 2 saves at step 2 (its two steps one process's), one process resumes there, and steps 3 to 5 are the
    uninterrupted one-process run's."""
    args = [*CONFIG, *short_documents]
    assert_cp2_checkpoint_resumes(tmp_path, args, whole)
