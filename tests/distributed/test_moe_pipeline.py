"""Qwen3-MoE under pipeline parallelism (gloo, fp32) gives one process's losses, grad norms, validation losses and
load-balancing terms: the pooled statistics travel with the activations and the last stage adds the one term
(titanlite/models/common/moe/balance.py). Each pipeline micro-batch forms its own term, so the one-process reference
runs the same micro-batches: 8 sequences one at a time, accumulated, as the pipeline cuts its 8 into micro-batches of
1. Beside FSDP or EP each rank cuts its own 4 sequences, and the last stage sums the statistics of its i-th
micro-batch over the data-parallel ranks (titanlite/parallel/parallelize.py pool_balance_over): the reference is then
FSDP x 2 accumulating the same micro-batches, sequences i and 4 + i, as no single process can run them."""

import pytest

from tests.helpers import VALIDATED, assert_matches, metrics, train_in_pool
from titanlite.parallel.pipeline import V_SHAPED, V_SHAPED_RUN

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # each run about 20 s on 2 CPU cores: CI runs them

MOE = ["--config", "train_configs/qwen3_moe_debug.toml", *VALIDATED]
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]  # micro-batches of 1 sequence (the default)


@pytest.fixture(scope="module")
def reference(one_process):
    return one_process([*MOE, "--training.local_batch_size", "1", "--training.global_batch_size", "8"])


@pytest.fixture(scope="module")
def data_parallel_reference(tmp_path_factory):
    """FSDP x 2, each rank accumulating its 4 sequences one at a time: the micro-batches of PP 2 x dp_shard 2."""
    run_dir = tmp_path_factory.mktemp("fsdp2_accumulating")
    args = [*MOE, "--training.local_batch_size", "1", "--training.global_batch_size", "8"]
    proc = train_in_pool(2, args, run_dir)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return metrics(run_dir)


def assert_same_run(run_dir, proc, reference, validated=True):
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    expected = reference if validated else [{k: v for k, v in r.items() if not k.startswith("val_")} for r in reference]
    records = metrics(run_dir)
    assert_matches(records, expected)
    for a, b in zip(records, expected):
        assert abs(a["aux_load_balance"] - b["aux_load_balance"]) <= 1e-5 * b["aux_load_balance"], (a, b)


V_SHAPED_TORCH = pytest.mark.skipif(not V_SHAPED_RUN, reason="V-shaped schedules are refused on this torch (2.11)")


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B", pytest.param("ZBVZeroBubble", marks=V_SHAPED_TORCH)])
def test_qwen3_moe_on_pp2_matches_one_process_with_the_same_micro_batches(tmp_path, reference, schedule):
    # 1F1B: 2 stages of 2 layers; the others 4 stages of 1 (stage 1 only the dense layer 1, passing the totals on;
    # ZBVZeroBubble puts stages 0 and 3 on rank 0, handing them over in place). V-shaped schedules cannot evaluate.
    args = [*MOE, *PP2, "--training.local_batch_size", "8", "--parallelism.pipeline_parallel_schedule", schedule]
    if schedule in V_SHAPED:
        args += ["--validation.enable", "false"]
    proc = train_in_pool(2, args, tmp_path)
    assert f"pipeline: {schedule}, {2 if schedule == '1F1B' else 4} stages" in proc.stdout
    assert_same_run(tmp_path, proc, reference, validated=schedule not in V_SHAPED)


@pytest.mark.parametrize(
    "layout, extra",
    [
        ("pp 2 x dp_shard 2 on 4", []),
        ("pp 2 x dp_shard 2 x ep 2", ["--parallelism.expert_parallel_degree", "2"]),
    ],
    ids=["fsdp2", "ep2"],
)
def test_qwen3_moe_on_pp2_with_data_or_expert_parallelism_on_4_ranks_matches_data_parallelism(
    tmp_path, data_parallel_reference, layout, extra
):
    args = [*MOE, *PP2, "--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "4", *extra]
    proc = train_in_pool(4, args, tmp_path)
    assert f"layout: {layout}" in proc.stdout
    assert_same_run(tmp_path, proc, data_parallel_reference)
