"""gpt-oss on expert parallelism x 2 (gloo, fp32) gives one process's losses, grad norms, validation losses and
load-balancing terms: the experts' biases shard with their matrices, and the sinks and biases train as on one
process. Each rank runs 4 of the global batch's 8 sequences of 32 tokens (past the debug model's window of 8) as one
micro-batch, whose load-balancing term is pooled over both ranks, as in tests/distributed/test_expert_parallel.py."""

import pytest

from tests.helpers import VALIDATED, assert_matches, metrics, train_in_pool

pytestmark = pytest.mark.distributed

GPT_OSS = [
    "--config", "train_configs/qwen3_moe_debug.toml", "--model.name", "gpt_oss", "--model.flavor", "debug",
    *VALIDATED, "--training.local_batch_size", "8",
]  # fmt: skip


@pytest.mark.slow  # two runs, about 25 s: CI runs it
def test_gpt_oss_on_expert_parallelism_matches_one_process(tmp_path):
    single = train_in_pool(1, GPT_OSS, tmp_path / "single")
    assert single.returncode == 0, single.stdout[-2000:] + single.stderr[-4000:]
    ep2 = ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "4"]
    ep = train_in_pool(2, [*GPT_OSS, *ep2], tmp_path / "ep2")
    assert ep.returncode == 0, ep.stdout[-2000:] + ep.stderr[-4000:]
    assert "model gpt_oss debug" in ep.stdout
    one, two = metrics(tmp_path / "single"), metrics(tmp_path / "ep2")
    assert_matches(two, one)
    for a, b in zip(two, one):
        assert abs(a["aux_load_balance"] - b["aux_load_balance"]) <= 1e-5 * b["aux_load_balance"], (a, b)
