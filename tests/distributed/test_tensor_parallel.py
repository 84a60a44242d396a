"""Tensor/sequence parallelism, alone and under FSDP (2-D), gives the single-process losses and grad norms."""

import pytest

from tests.distributed.conftest import CONFIGS
from tests.helpers import VALIDATED, assert_matches, metrics, run_train_sh, train_in_pool

pytestmark = pytest.mark.distributed

TP2 = ["--parallelism.tensor_parallel_degree", "2"]


SLOW = pytest.mark.slow
# In the default suite: TP x 2 for both models and FSDP 2 x TP 2 for GPT-2. With the chunked loss (the CPU
# default) TP x 2 with disable_loss_parallel runs the same vocabulary-parallel loss, so it is slow (CI).
CASES = [
    ("tp2_loss_parallel", 2, ["--training.local_batch_size", "8"], "gpt2"),
    ("tp2_loss_parallel", 2, ["--training.local_batch_size", "8"], "llama3"),
    pytest.param(
        "tp2_gathered_logits",
        2,
        ["--training.local_batch_size", "8", "--parallelism.disable_loss_parallel"],
        "gpt2",
        marks=SLOW,
    ),
    pytest.param(
        "tp2_gathered_logits",
        2,
        ["--training.local_batch_size", "8", "--parallelism.disable_loss_parallel"],
        "llama3",
        marks=SLOW,
    ),
    pytest.param("fsdp2_x_tp2", 4, ["--training.local_batch_size", "4"], "gpt2", marks=SLOW),  # 2-D: PP x FSDP stays
    pytest.param("fsdp2_x_tp2", 4, ["--training.local_batch_size", "4"], "llama3", marks=SLOW),
]


@pytest.mark.parametrize("name, nproc, args, model", CASES)
def test_tensor_parallel_matches_single_device(tmp_path, reference, model, name, nproc, args):
    proc = train_in_pool(nproc, ["--config", CONFIGS[model], *VALIDATED, *TP2, *args], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    expected_layout = "dp_shard 2 x tp 2" if nproc == 4 else "tp 2"
    assert f"layout: {expected_layout} on {nproc} cpu" in proc.stdout
    assert_matches(metrics(tmp_path), reference(model))


@pytest.mark.slow  # CI runs it; the default suite launches FSDP x 2 through NGPU=2 ./run_train.sh
# (test_data_parallel.py) and runs TP x 2 in the pool (above)
def test_tp_via_run_train_sh(tmp_path, reference):
    proc = run_train_sh([*VALIDATED, *TP2, "--training.local_batch_size", "8"], tmp_path, ngpu=2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert_matches(metrics(tmp_path), reference("gpt2"))
