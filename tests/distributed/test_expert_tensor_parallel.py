"""Expert tensor parallelism beyond DeepSeek-V3 (whose layouts tests/distributed/test_deepseek_v3.py runs, and
Qwen3-MoE's test_expert_parallel.py): Qwen3-Next's MoE blocks gate their shared expert with a sigmoid of a linear
layer, whose output multiplies the shared expert's partial sum under ETP, so its gradient must be summed over TP
too (expert_tensor_parallel.moe_etp_plan). TP x 2 with the experts split gives one process's losses and grad norms."""

import pytest

from tests.helpers import TINY, assert_matches, metrics, train_in_pool

pytestmark = pytest.mark.distributed

BATCH = ["--training.global_batch_size", "4", "--training.local_batch_size", "4"]
ETP = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_tensor_parallel_degree", "2"]


@pytest.mark.slow  # two short runs, about 5 s: CI runs them
def test_a_gated_shared_expert_split_over_tp_matches_one_process(tmp_path):
    base = ["--config", "train_configs/qwen3_next_debug.toml", *TINY, *BATCH]
    for name, nproc, extra in (("one", 1, []), ("etp", 2, ETP)):
        proc = train_in_pool(nproc, [*base, *extra], tmp_path / name)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert_matches(metrics(tmp_path / "etp"), metrics(tmp_path / "one"))
