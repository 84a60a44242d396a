"""Qwen3.5 on real layouts (gloo, fp32, block-causal documents): its debug model (three Gated DeltaNet layers, one
gated full-attention layer) gives one process's losses, grad norms and validation losses on FSDP x 2, TP x 2 (the
linear layers split by heads: projections, convolutions, decays) and PP x 2; Qwen3.5-MoE on EP x 2 gives one
process's too, load-balancing term included. Context parallelism: tests/distributed/test_context_parallel.py."""

import pytest

from tests.distributed.test_expert_parallel import assert_same_run
from tests.distributed.test_model_families import LAYOUTS
from tests.helpers import VALIDATED, assert_matches, metrics, train_in_pool

pytestmark = pytest.mark.distributed

QWEN3_5 = ["--config", "train_configs/qwen3_5_debug.toml", *VALIDATED]
MOE = ["--config", "train_configs/qwen3_5_moe_debug.toml", *VALIDATED]


def train(nproc: int, args: list[str], run_dir) -> list[dict]:
    proc = train_in_pool(nproc, args, run_dir)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return metrics(run_dir)


# TP x 2 stays in the default suite (the one layout that splits the linear layers' own tensors); FSDP and PP are slow.
@pytest.mark.parametrize(
    "layout", [pytest.param("fsdp2", marks=pytest.mark.slow), "tp2", pytest.param("pp2", marks=pytest.mark.slow)]
)
def test_qwen3_5_on_a_layout_matches_one_process(tmp_path, reference, layout):
    nproc, args = LAYOUTS[layout]
    assert_matches(train(nproc, [*QWEN3_5, *args], tmp_path), reference("qwen3_5"))


@pytest.mark.slow
def test_qwen3_5_moe_on_expert_parallelism_matches_one_process(tmp_path):
    one = train(1, [*MOE, "--training.local_batch_size", "8"], tmp_path / "one")
    assert all(r["aux_load_balance"] > 0 for r in one)
    ep2 = ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "4"]
    assert_same_run(train(2, [*MOE, *ep2], tmp_path / "ep2"), one)
