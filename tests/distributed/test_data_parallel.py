"""Every data-parallel layout gives the single-process losses and grad norms (fp32, CPU, real gloo collectives).

Global batch 8 sequences of 32 tokens in every run; only how the batch is split across ranks changes.
"""

import pytest

from tests.helpers import VALIDATED, assert_matches, metrics, train_in_pool

pytestmark = pytest.mark.distributed


def test_zero3_via_run_train_sh_matches_single_device(zero3_launch, reference):
    # NGPU=2 with the default config is FSDP over 2 ranks, resharding after forward (ZeRO-3).
    proc, run_dir = zero3_launch
    assert "layout: dp_shard 2 on 2 cpu process(es)" in proc.stdout
    assert_matches(metrics(run_dir), reference())


@pytest.mark.parametrize(
    "name, nproc, args",
    [
        pytest.param("zero2", 4, ["--parallelism.fsdp_reshard_after_forward", "never"], marks=pytest.mark.slow),
        pytest.param(  # DDP x 2 (test_gradient_accumulation_matches_one_big_batch) stays in the default suite
            "ddp",
            4,
            ["--parallelism.data_parallel_replicate_degree", "4", "--parallelism.data_parallel_shard_degree", "1"],
            marks=pytest.mark.slow,
        ),
        (
            "hsdp",
            4,
            ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"],
        ),
    ],
)
def test_layout_matches_single_device(tmp_path, reference, name, nproc, args):
    proc = train_in_pool(nproc, [*VALIDATED, "--training.local_batch_size", "2", *args], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert_matches(metrics(tmp_path), reference())


@pytest.mark.parametrize(
    "name, nproc, args",
    [
        pytest.param("single_process", 1, [], marks=pytest.mark.slow),  # DDP x 2 stays in the default suite
        pytest.param("zero3", 2, [], marks=pytest.mark.slow),
        (
            "ddp",
            2,
            ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
        ),
    ],
)
def test_gradient_accumulation_matches_one_big_batch(tmp_path, reference, name, nproc, args):
    # local batch 2 with accumulation making up the global batch of 8 (4 micro-batches on 1 rank, 2 on 2 ranks)
    proc = train_in_pool(
        nproc, [*VALIDATED, "--training.local_batch_size", "2", "--training.global_batch_size", "8", *args], tmp_path
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert f"accumulation {4 // nproc}" in proc.stdout
    assert_matches(metrics(tmp_path), reference())


def test_fsdp_on_one_rank_matches_single_device(tmp_path, reference):
    # The one-rank FSDP mesh that CPU offload uses on one GPU (here without offload: the CPU has no CUDA).
    proc = train_in_pool(
        1, [*VALIDATED, "--training.local_batch_size", "8", "--parallelism.fsdp_single_rank"], tmp_path
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "layout: single device (FSDP on one rank) on 1 cpu process(es)" in proc.stdout
    assert_matches(metrics(tmp_path), reference())
