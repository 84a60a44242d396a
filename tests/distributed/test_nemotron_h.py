"""Nemotron-H on real layouts (gloo, fp32, block-causal short documents, so every window crosses documents and documents
cross the ranks' chunks): its debug model (Mamba-2, attention and MLP layers of one sublayer each) gives one
process's losses, grad norms and validation losses on FSDP x 2, TP x 2 (the Mamba layers split by heads and groups:
projections, convolution, A_log, D, dt_bias, the gated norm's slices), PP x 2, CP x 2 and CP x 4, and its mixture-of-
experts flavor on EP x 2, TP x 2 and PP x 2; a CP x 2 checkpoint resumed on one process continues the uninterrupted
losses. The Mamba layers' carried state shows in these losses: from the debug flavor's init the steps are small
(dt_bias log-uniform in [0.001, 0.1]) and the decays slow (exp(-dt A) with A = 1..H): with the bug planted in
ContextParallelStateScan (its `read` of the incoming state left out), the CP x 2 and CP x 4 runs' step-2 losses moved
by 2.0e-4 and 1.7e-4 relative, 20 x the tolerance. All run with the slow tests (CI); the default suite holds the Mamba
layer's CP x 2 (tests/distributed/test_linear_context_parallel.py) and the Mamba TP split (Granite 4.0 H's)."""

import pytest

from tests.distributed.test_context_parallel import (
    assert_cp2_checkpoint_resumes,
    cp,
    short_documents,  # noqa: F401 (the fixture `documents` asks for)
)
from tests.distributed.test_expert_parallel import EP2, assert_same_run
from tests.distributed.test_model_families import LAYOUTS
from tests.helpers import assert_matches, metrics, train_in_pool

pytestmark = pytest.mark.distributed

CONFIG = ["--config", "train_configs/nemotron_h_debug.toml"]
ONE = ["--training.local_batch_size", "8"]  # the global batch of 8 on one process
MOE = ["--model.flavor", "debug_moe"]


@pytest.fixture(scope="module")
def whole(one_process, short_documents) -> list[dict]:  # noqa: F811
    """One process over the global batch of 8, block-causal short documents (once per pytest run)."""
    return one_process([*CONFIG, *short_documents, *ONE])


def train(nproc: int, args: list[str], run_dir) -> list[dict]:
    proc = train_in_pool(nproc, args, run_dir)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return metrics(run_dir)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [*LAYOUTS, "cp4"],
)
def test_nemotron_h_on_a_layout_matches_one_process(tmp_path, whole, short_documents, layout):  # noqa: F811
    nproc, args = (4, cp(4)) if layout == "cp4" else LAYOUTS[layout]
    assert_matches(train(nproc, [*CONFIG, *short_documents, *args], tmp_path), whole)


@pytest.fixture(scope="module")
def moe_whole(one_process, short_documents) -> list[dict]:  # noqa: F811
    """One process of the mixture-of-experts debug flavor (relu^2 experts in a latent width, a shared expert, routing
    biases moved by the step's counts)."""
    return one_process([*CONFIG, *short_documents, *MOE, *ONE])


@pytest.mark.slow  # a 2-rank run each, beside the one-process reference
@pytest.mark.parametrize("layout", ["ep2", "tp2", "pp2"])
def test_nemotron3_moe_on_a_layout_matches_one_process(tmp_path, moe_whole, short_documents, layout):  # noqa: F811
    """EP x 2 over dp_shard 2 (the experts split), TP x 2 (the block whole on each rank), PP x 2: one process's
    losses, grad norms, validation losses and expert loads."""
    nproc, args = EP2 if layout == "ep2" else LAYOUTS[layout]
    proc = train_in_pool(nproc, [*CONFIG, *short_documents, *MOE, *args], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert layout != "ep2" or "ep 2 (of shard x cp)" in proc.stdout
    assert_same_run(metrics(tmp_path), moe_whole)


@pytest.mark.slow  # a one-process reference and two 2-rank runs
def test_nemotron3_multi_token_prediction_on_tp2_and_pp2_matches_one_process(
    tmp_path,
    one_process,
    short_documents,  # noqa: F811
):
    """The mixture-of-experts flavor with a multi-token prediction depth (attention then the experts, after the
    fusion): TP x 2 (the depth's block split as the model's) and PP x 2 (the depth on the last stage) give one
    process's losses, grad norms and validation losses, the depth's loss inside them."""
    args = [*CONFIG, *short_documents, *MOE, "--model.mtp_layers", "1"]
    one = one_process([*args, *ONE])
    assert all(r["mtp_loss"] > 0 for r in one)
    for layout in ("tp2", "pp2"):
        nproc, extra = LAYOUTS[layout]
        proc = train_in_pool(nproc, [*args, *extra], tmp_path / layout)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        assert_matches(metrics(tmp_path / layout), one)


@pytest.mark.slow  # a one-process reference, a 2-rank and a 1-rank run
def test_a_nemotron_h_cp2_checkpoint_resumes_on_one_process_with_the_uninterrupted_losses(
    tmp_path,
    whole,
    short_documents,  # noqa: F811
):
    """CP x 2 saves at step 2 (its two steps one process's), one process resumes there, and steps 3 to 5 are the
    uninterrupted one-process run's."""
    args = [*CONFIG, *short_documents]
    assert_cp2_checkpoint_resumes(tmp_path, args, whole)
