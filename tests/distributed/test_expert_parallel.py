"""Expert parallelism (gloo, fp32) gives one process's losses, grad norms, validation losses and load-balancing terms,
alone and beside FSDP, HSDP, tensor and context parallelism, with the load-balancing loss and with the bias method
(whose expert loads and biases must then agree), and its checkpoints resume on other EP degrees.

Every layout runs the global batch of 8 as one micro-batch, 8 / dp sequences a rank, as the one-process reference
runs its 8: the load-balancing term is pooled over every rank of the micro-batch (titanlite/parallel/parallelize.py
pool_balance_over), so each layout's term is one process's. Under pipeline parallelism each rank cuts its sequences
into micro-batches, each with its own term: tests/distributed/test_moe_pipeline.py compares PP 2 x EP 2 with a run
of the same micro-batches; here it runs with the bias method, which has no term."""

import json
import shutil

import pytest

from tests.helpers import VALIDATED, assert_close, assert_matches, metrics, train_in_pool

pytestmark = pytest.mark.distributed

MOE = ["--config", "train_configs/qwen3_moe_debug.toml", *VALIDATED]
CHECKPOINTED = ["--checkpoint.enable", "--checkpoint.interval", "3"]
# The bias method at a rate that moves the biases enough to change the routing within the run.
BIAS = ["--moe.balance", "bias", "--moe.bias_update_rate", "0.01"]
EP = "--parallelism.expert_parallel_degree"
LOCAL = "--training.local_batch_size"  # 8 / dp: the global batch of 8 is one micro-batch on every layout
EP2 = (2, [EP, "2", LOCAL, "4"])
FSDP2_EP2 = (4, [EP, "2", LOCAL, "2"])  # dp_shard 4: each expert shard is FSDP-sharded over 2 ranks
LAYOUTS = {
    "ep4": (4, [EP, "4", LOCAL, "2"]),
    "hsdp_ep2": (4, ["--parallelism.data_parallel_replicate_degree", "2", EP, "2", LOCAL, "2"]),  # 2 x (dp_shard 2)
    "ep2_tp2": (4, [EP, "2", "--parallelism.tensor_parallel_degree", "2", LOCAL, "4"]),  # dp_shard 2
    "ep2_cp2": (4, [EP, "2", "--parallelism.context_parallel_degree", "2", LOCAL, "4"]),  # dp_shard 2 x cp 2
    # TP with the experts split over it (ETP 2): each rank computes half of every expert's width
    "tp2_etp2": (
        2,
        [
            "--parallelism.tensor_parallel_degree",
            "2",
            "--parallelism.expert_tensor_parallel_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "1",
            LOCAL,
            "8",
        ],
    ),
    # TP alone: the attention split into DTensors, the MoE blocks whole and plain, one optimizer over both kinds
    "tp2": (
        2,
        ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1", LOCAL, "8"],
    ),
}
# PP 2 x dp_shard 2, EP 2: each rank's 4 sequences in pipeline micro-batches of 2.
PP2_EP2 = (
    4,
    [
        EP,
        "2",
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_microbatch_size",
        "2",
        LOCAL,
        "4",
    ],
)


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
def moe_reference(reference):
    """One process running the global batch of 8 (tests/distributed/conftest.py, shared with test_qwen3_moe.py)."""
    return reference("qwen3_moe")


@pytest.fixture(scope="module")
def bias_reference(one_process):
    return one_process([*MOE, LOCAL, "8", *BIAS])


@pytest.fixture(scope="module")
def ep2(tmp_path_factory):
    """EP x 2 on 2 ranks (each holds 4 of the 8 experts and 4 of the 8 sequences), checkpointed at steps 3 and 5."""
    run_dir = tmp_path_factory.mktemp("ep2")
    nproc, args = EP2
    proc = train(nproc, [*args, *CHECKPOINTED], run_dir)
    return run_dir, proc


def test_ep2_matches_one_process(moe_reference, ep2):
    run_dir, proc = ep2
    assert "ep 2 (of shard x cp)" in proc.stdout
    assert_same_run(metrics(run_dir), moe_reference)


def test_fsdp2_ep2_matches_one_process(tmp_path, moe_reference):
    """dp_shard 4, EP 2: the term pooled over the four ranks' 2 sequences each, the experts' FSDP over 2 ranks."""
    proc = train(*FSDP2_EP2, tmp_path)
    assert "layout: dp_shard 4 x ep 2 (of shard x cp)" in proc.stdout
    assert_same_run(metrics(tmp_path), moe_reference)


@pytest.mark.slow  # four 4-rank runs and two 2-rank ones, about 100 s: CI runs them
@pytest.mark.parametrize("layout", LAYOUTS)
def test_expert_parallel_layouts_match_one_process(tmp_path, moe_reference, layout):
    nproc, args = LAYOUTS[layout]
    train(nproc, args, tmp_path)
    assert_same_run(metrics(tmp_path), moe_reference)


@pytest.mark.slow  # eight runs, about 2 minutes: CI runs them
@pytest.mark.parametrize("layout", ["ep2", "fsdp2_ep2", *LAYOUTS, "ep2_pp2"])
def test_expert_parallel_layouts_with_the_bias_method_match_one_process(tmp_path, bias_reference, layout):
    """The biases move by the step's counts summed over dp x cp: every layout routes as one process does."""
    nproc, args = {"ep2": EP2, "fsdp2_ep2": FSDP2_EP2, "ep2_pp2": PP2_EP2, **LAYOUTS}[layout]
    train(nproc, [*args, *BIAS], tmp_path)
    records = metrics(tmp_path)
    assert "aux_load_balance" not in records[0]
    assert_same_run(records, bias_reference)


@pytest.mark.slow  # two runs, about 30 s: CI runs them
@pytest.mark.parametrize("nproc, ep", [(2, 1), (4, 4)])
def test_an_ep2_checkpoint_resumes_on_another_ep_degree(tmp_path, ep2, nproc, ep):
    """The EP x 2 run's step-3 checkpoint continues on EP x 1 (FSDP x 2) and on EP x 4 (2 sequences a rank, the
    same global batch) with its losses and load-balancing terms."""
    straight, _ = ep2
    (tmp_path / "run").mkdir()
    shutil.copytree(straight / "run" / "step-3", tmp_path / "run" / "step-3")
    first = (straight / "run" / "metrics.jsonl").read_text().splitlines()[:3]
    (tmp_path / "run" / "metrics.jsonl").write_text("\n".join(first) + "\n")
    proc = train(nproc, [EP, str(ep), LOCAL, str(8 // nproc), *CHECKPOINTED], tmp_path)
    assert "resumed from" in proc.stdout and "at step 3" in proc.stdout
    resumed, expected = metrics(tmp_path), metrics(straight)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5]
    assert_close([r["loss"] for r in resumed[3:]], [r["loss"] for r in expected[3:]], 1e-5)
    assert_close([r["aux_load_balance"] for r in resumed[3:]], [r["aux_load_balance"] for r in expected[3:]], 1e-5)
    assert json.loads(first[-1])["step"] == 3
