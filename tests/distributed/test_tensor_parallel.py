"""Tensor/sequence parallelism, alone and under FSDP (2-D), gives the single-process losses and grad norms."""

import pytest

from tests.distributed.conftest import CONFIGS
from tests.helpers import VALIDATED, assert_matches, metrics, run_train_sh, torchrun

pytestmark = pytest.mark.distributed

TP2 = ["--parallelism.tensor_parallel_degree", "2"]


@pytest.mark.parametrize("model", ["gpt2", "llama3"])
@pytest.mark.parametrize(
    "name, nproc, args",
    [
        ("tp2_loss_parallel", 2, ["--training.local_batch_size", "8"]),
        ("tp2_gathered_logits", 2, ["--training.local_batch_size", "8", "--parallelism.disable_loss_parallel"]),
        ("fsdp2_x_tp2", 4, ["--training.local_batch_size", "4"]),
    ],
)
def test_tensor_parallel_matches_single_device(tmp_path, reference, model, name, nproc, args):
    proc = torchrun(nproc, ["--config", CONFIGS[model], *VALIDATED, *TP2, *args], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    expected_layout = "dp_shard 2 x tp 2" if nproc == 4 else "tp 2"
    assert f"layout: {expected_layout} on {nproc} cpu" in proc.stdout
    assert_matches(metrics(tmp_path), reference(model))


def test_tp_via_run_train_sh(tmp_path, reference):
    proc = run_train_sh([*VALIDATED, *TP2, "--training.local_batch_size", "8"], tmp_path, ngpu=2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert_matches(metrics(tmp_path), reference("gpt2"))
