"""Every data-parallel layout gives the single-process losses and grad norms (fp32, CPU, real gloo collectives).

Global batch 8 sequences of 32 tokens in every run; only how the batch is split across ranks changes.
"""

import pytest

from tests.helpers import TINY, assert_close, metrics, run_train_sh, torchrun

pytestmark = pytest.mark.distributed
RTOL = 1e-5
# Grad norms agree to ~1e-6 at step 1; after that Adam's normalisation of near-zero gradients turns
# float32 reduction-order noise into weight differences too small to move the loss (~1e-7) but
# visible in the norm (~3e-5 by step 5).
GRAD_NORM_RTOL = 1e-4


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single")
    proc = torchrun(1, [*TINY, "--training.local_batch_size", "8"], run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return metrics(run_dir)


def check_matches(records, single):
    assert_close([r["loss"] for r in records], [r["loss"] for r in single], RTOL)
    assert_close([r["grad_norm"] for r in records], [r["grad_norm"] for r in single], GRAD_NORM_RTOL)


def test_zero3_via_run_train_sh_matches_single_device(tmp_path, single):
    # NGPU=4 with the default config is FSDP over 4 ranks, resharding after forward (ZeRO-3).
    proc = run_train_sh([*TINY, "--training.local_batch_size", "2"], tmp_path, ngpu=4)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "layout: dp_shard 4 on 4 cpu process(es)" in proc.stdout
    check_matches(metrics(tmp_path), single)


@pytest.mark.parametrize(
    "name, nproc, args",
    [
        ("zero2", 4, ["--parallelism.fsdp_reshard_after_forward", "never"]),
        ("ddp", 4, ["--parallelism.data_parallel_replicate_degree", "4", "--parallelism.data_parallel_shard_degree", "1"]),
        ("hsdp", 4, ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"]),
    ],
)
def test_layout_matches_single_device(tmp_path, single, name, nproc, args):
    proc = torchrun(nproc, [*TINY, "--training.local_batch_size", "2", *args], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    check_matches(metrics(tmp_path), single)


@pytest.mark.parametrize(
    "name, nproc, args",
    [
        ("single_process", 1, []),
        ("zero3", 2, []),
        ("ddp", 2, ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]),
    ],
)
def test_gradient_accumulation_matches_one_big_batch(tmp_path, single, name, nproc, args):
    # local batch 2 with accumulation making up the global batch of 8 (4 micro-batches on 1 rank, 2 on 2 ranks)
    proc = torchrun(nproc, [*TINY, "--training.local_batch_size", "2", "--training.global_batch_size", "8", *args], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert f"accumulation {4 // nproc}" in proc.stdout
    check_matches(metrics(tmp_path), single)
