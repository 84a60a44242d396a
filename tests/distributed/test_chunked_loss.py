"""The chunked output projection + cross-entropy (titanlite/components/loss.py) against the plain loss.

Every layout trains two steps with checkpoints after each, global batch 8 x 32 tokens, in chunks of 20
tokens (so each micro-batch is cut unevenly, and under PP each 32-token pipeline micro-batch too); the
reference is one process with the plain F.cross_entropy on the full logits. The losses and gradient
norms must agree to 1e-5, and so must every gradient: after AdamW's first step, the checkpoint's first
moment is 0.1 x the clipped gradient and the second 0.05 x its square, for every parameter (the updated
weights themselves to 1e-4).
"""

import pytest

from tests.helpers import GRAD_NORM_RTOL, TINY, assert_close, checkpoint_tensors, metrics, train_in_pool

pytestmark = pytest.mark.distributed

TWO_STEPS = [*TINY, "--training.steps", "2", "--checkpoint.enable", "--checkpoint.interval", "1"]
CHUNKED = ["--training.loss_chunk_tokens", "20"]
LAYOUTS = {
    "single": (1, ["--training.local_batch_size", "8"]),
    "fsdp2": (2, ["--training.local_batch_size", "4"]),
    "tp2": (2, ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"]),
    "pp2": (
        2,
        [
            "--training.local_batch_size",
            "8",
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "1F1B",
        ],
    ),
}
RTOL = 1e-5


def train(run_dir, nproc, args):
    proc = train_in_pool(nproc, [*TWO_STEPS, *args], run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return metrics(run_dir)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("plain")
    records = train(run_dir, 1, ["--training.local_batch_size", "8", "--training.loss_chunk_tokens", "0"])
    return records, checkpoint_tensors(run_dir / "run" / "step-1", run_dir / "scratch")


# One process is slow (CI runs it): the layouts, which split the loss, stay in the default suite.
@pytest.mark.parametrize("layout", [pytest.param(k, marks=pytest.mark.slow) if k == "single" else k for k in LAYOUTS])
def test_chunked_loss_matches_the_plain_loss(tmp_path, plain, layout):
    nproc, args = LAYOUTS[layout]
    records = train(tmp_path, nproc, [*args, *CHUNKED])
    reference, reference_tensors = plain
    assert_close([r["loss"] for r in records], [r["loss"] for r in reference], RTOL)
    # Step 1's gradients come from the same weights; step 2's norm also carries AdamW's first update of
    # the noise-only key biases (below), so it gets the layout tests' 1e-4 (tests/helpers.py).
    assert_close([records[0]["grad_norm"]], [reference[0]["grad_norm"]], RTOL)
    assert_close([records[1]["grad_norm"]], [reference[1]["grad_norm"]], GRAD_NORM_RTOL)
    tensors = checkpoint_tensors(tmp_path / "run" / "step-1", tmp_path / "scratch")
    assert tensors.keys() == reference_tensors.keys()
    for name in tensors:  # every parameter's gradient is compared (GPT-2's output.weight is the embedding)
        if name.startswith("model.") and name != "model.output.weight":
            assert f"optimizer.state.{name.removeprefix('model.')}.exp_avg" in tensors, name
    errors = {}
    for name, value in tensors.items():
        expected = reference_tensors[name].double()
        errors[name] = float((value.double() - expected).norm() / expected.norm().clamp_min(1e-30))
    # The key projection's bias adds the same amount to every score of a query's row, which softmax
    # ignores: its exact gradient is zero, both runs hold rounding noise there (and AdamW's first step
    # turns noise into +-lr), so it has nothing to compare.
    # The weights after the step get the layout tests' 1e-4: AdamW's first step divides each gradient by
    # its magnitude, so elements whose gradient is near rounding move by a relative ulp-sized amount.
    bad = {
        name: f"{e:.1e}"
        for name, e in errors.items()
        if e > (RTOL if name.startswith("optimizer.") else GRAD_NORM_RTOL) and "attention.wk.bias" not in name
    }
    assert not bad, bad
