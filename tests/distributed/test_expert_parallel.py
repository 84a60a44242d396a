"""Expert parallelism (gloo, fp32) gives one process's losses, grad norms, validation losses and load-balancing terms,
alone and beside FSDP, HSDP, tensor, context and pipeline parallelism, with the load-balancing loss and with the
bias method (whose expert loads and biases must then agree), and its checkpoints resume on other EP degrees.

Every run takes micro-batches of 2 sequences (a global batch of 8): the load-balancing term is a function of a
micro-batch's routing as a whole (transformers' pooled loss), so the one-process reference accumulates the same 4
micro-batches that the ranks of each layout run."""

import json
import shutil

import pytest

from tests.helpers import VALIDATED, assert_close, assert_matches, metrics, train_in_pool

pytestmark = pytest.mark.distributed

MOE = [
    "--config",
    "train_configs/qwen3_moe_debug.toml",
    *VALIDATED,
    "--training.global_batch_size",
    "8",
    "--training.local_batch_size",
    "2",
]
CHECKPOINTED = ["--checkpoint.enable", "--checkpoint.interval", "3"]
# The bias method at a rate that moves the biases enough to change the routing within the run.
BIAS = ["--moe.balance", "bias", "--moe.bias_update_rate", "0.01"]
EP = "--parallelism.expert_parallel_degree"
LAYOUTS = {
    "ep4": (4, [EP, "4"]),
    "fsdp2_ep2": (4, [EP, "2"]),  # dp_shard 4: each expert shard is FSDP-sharded over 2 ranks
    "hsdp_ep2": (4, ["--parallelism.data_parallel_replicate_degree", "2", EP, "2"]),  # replicas of EP 2 x dp_shard 2
    "ep2_tp2": (4, [EP, "2", "--parallelism.tensor_parallel_degree", "2"]),
    "ep2_cp2": (4, [EP, "2", "--parallelism.context_parallel_degree", "2"]),
    # Pipeline micro-batches of 2 sequences, as the reference's: PP 2 x dp_shard 2, EP 2.
    "ep2_pp2": (
        4,
        [
            EP,
            "2",
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_microbatch_size",
            "2",
        ],
    ),
}


def train(nproc, args, run_dir):
    proc = train_in_pool(nproc, [*MOE, *args], run_dir)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def assert_same_run(records, reference):
    assert_matches(records, reference)
    if "aux_load_balance" in reference[0]:
        assert_close([r["aux_load_balance"] for r in records], [r["aux_load_balance"] for r in reference], 1e-5)
    assert_close([r["expert_load"] for r in records], [r["expert_load"] for r in reference], 1e-6)


@pytest.fixture(scope="module")
def reference(one_process):
    return one_process(MOE)


@pytest.fixture(scope="module")
def bias_reference(one_process):
    return one_process([*MOE, *BIAS])


@pytest.fixture(scope="module")
def ep2(tmp_path_factory):
    """EP x 2 on 2 ranks (each holds 4 of the 8 experts), checkpointed at steps 3 and 5."""
    run_dir = tmp_path_factory.mktemp("ep2")
    proc = train(2, [EP, "2", *CHECKPOINTED], run_dir)
    return run_dir, proc


def test_ep2_matches_one_process(reference, ep2):
    run_dir, proc = ep2
    assert "ep 2 (of shard x cp)" in proc.stdout
    assert_same_run(metrics(run_dir), reference)


@pytest.mark.slow  # six 4-rank runs, about 2 minutes: CI runs them
@pytest.mark.parametrize("layout", LAYOUTS)
def test_expert_parallel_layouts_match_one_process(tmp_path, reference, layout):
    nproc, args = LAYOUTS[layout]
    train(nproc, args, tmp_path)
    assert_same_run(metrics(tmp_path), reference)


@pytest.mark.slow  # seven runs, about 2 minutes: CI runs them
@pytest.mark.parametrize("layout", ["ep2", *LAYOUTS])
def test_expert_parallel_layouts_with_the_bias_method_match_one_process(tmp_path, bias_reference, layout):
    """The biases move by the step's counts summed over dp x cp: every layout routes as one process does."""
    nproc, args = LAYOUTS.get(layout, (2, [EP, "2"]))
    train(nproc, [*args, *BIAS], tmp_path)
    records = metrics(tmp_path)
    assert "aux_load_balance" not in records[0]
    assert_same_run(records, bias_reference)


@pytest.mark.slow  # two runs, about 30 s: CI runs them
@pytest.mark.parametrize("nproc, ep", [(2, 1), (4, 4)])
def test_an_ep2_checkpoint_resumes_on_another_ep_degree(tmp_path, ep2, nproc, ep):
    """The EP x 2 run's step-3 checkpoint continues on EP x 1 (FSDP x 2) and on EP x 4 with its losses."""
    straight, _ = ep2
    (tmp_path / "run").mkdir()
    shutil.copytree(straight / "run" / "step-3", tmp_path / "run" / "step-3")
    first = (straight / "run" / "metrics.jsonl").read_text().splitlines()[:3]
    (tmp_path / "run" / "metrics.jsonl").write_text("\n".join(first) + "\n")
    proc = train(nproc, [EP, str(ep), *CHECKPOINTED], tmp_path)
    assert "resumed from" in proc.stdout and "at step 3" in proc.stdout
    resumed, expected = metrics(tmp_path), metrics(straight)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5]
    assert_close([r["loss"] for r in resumed[3:]], [r["loss"] for r in expected[3:]], 1e-5)
    assert_close([r["aux_load_balance"] for r in resumed[3:]], [r["aux_load_balance"] for r in expected[3:]], 1e-5)
    assert json.loads(first[-1])["step"] == 3
