"""Muon (optimizer.name = "Muon", gloo, fp32, the Newton-Schulz iteration too: muon_ns_dtype 'auto' on the CPU) on the
tiny Qwen3-MoE gives one process's losses on FSDP x 2, TP x 2, EP x 2, FSDP 2 x TP 2, HSDP, TP x 2 with the experts
split (ETP) and PP x 2 over 10 steps, and its checkpoint resumes on another layout with the uninterrupted run's
losses.

Every layout runs the global batch of 8 as one micro-batch, as the one-process reference does: the attention's
matrices are FSDP- and TP-sharded DTensors, each made whole on one owner rank (all-to-all there and back) or, split
over two mesh dimensions or with muon_orthogonalize_on = "every_rank", on every rank (all-gather); the experts'
stacks are EP-sharded by expert (each rank orthogonalises its own)."""

import shutil

import pytest

from tests.helpers import TINY, assert_close, metrics, train_in_pool

pytestmark = pytest.mark.distributed

LOCAL = "--training.local_batch_size"
STEPS = ["--training.steps", "10"]
MUON = [
    "--config",
    "train_configs/qwen3_moe_debug.toml",
    *TINY,
    *STEPS,
    "--optimizer.name",
    "Muon",
    "--optimizer.muon_lr",
    "0.003",
    "--optimizer.muon_adjust_lr",
    "match_rms_adamw",
]  # muon_ns_dtype 'auto': float32 on the CPU (bfloat16 turns float32's reduction-order noise into ~1e-4)
TP = "--parallelism.tensor_parallel_degree"
LAYOUTS = {
    "fsdp2": (2, [LOCAL, "4"]),
    "tp2": (2, [TP, "2", "--parallelism.data_parallel_shard_degree", "1", LOCAL, "8"]),
    "ep2": (2, ["--parallelism.expert_parallel_degree", "2", LOCAL, "4"]),
    "fsdp2_tp2": (4, [TP, "2", LOCAL, "4"]),  # matrices split over two mesh dims: gathered on every rank
    # each matrix all-gathered and orthogonalised on both ranks, where the others have one owner per matrix
    "hsdp": (4, ["--parallelism.data_parallel_replicate_degree", "2", LOCAL, "2"]),  # owners within each replica
    "fsdp2_every_rank": (2, [LOCAL, "4", "--optimizer.muon_orthogonalize_on", "every_rank"]),
    # the experts' stacks split over TP on their width (expert tensor parallelism): made whole over TP per expert
    "etp2": (
        2,
        [
            TP,
            "2",
            "--parallelism.expert_tensor_parallel_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "1",
            LOCAL,
            "8",
        ],
    ),
}
# Pipeline stages each step their own layers' matrices. Each pipeline micro-batch would get a load-balancing term of
# its own, so the PP comparison runs without one (its reference too).
NO_BALANCE = ["--moe.balance", "none"]
PP = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B", LOCAL, "8"]
CHECKPOINTED = ["--checkpoint.enable", "--checkpoint.interval", "5"]


def train(nproc, args, run_dir):
    proc = train_in_pool(nproc, [*MUON, *args], run_dir)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def muon_reference(one_process):
    return one_process([*MUON, LOCAL, "8"])


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory):
    """FSDP x 2, checkpointed at steps 5 and 10: compared with one process and resumed on EP x 2."""
    run_dir = tmp_path_factory.mktemp("muon_fsdp2")
    nproc, args = LAYOUTS["fsdp2"]
    proc = train(nproc, [*args, *CHECKPOINTED], run_dir)
    return run_dir, proc


def assert_same_losses(records, reference):
    assert [r["step"] for r in records] == [r["step"] for r in reference]
    assert_close([r["loss"] for r in records], [r["loss"] for r in reference], 1e-5)
    assert_close([records[0]["grad_norm"]], [reference[0]["grad_norm"]], 1e-6)


def test_muon_on_fsdp2_matches_one_process(muon_reference, fsdp2_run):
    run_dir, proc = fsdp2_run
    assert "optimizer: Muon" in proc.stdout
    assert_same_losses(metrics(run_dir), muon_reference)


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param("tp2", marks=pytest.mark.slow),  # about 10 s; CI runs it
        "ep2",
        pytest.param("fsdp2_tp2", marks=pytest.mark.slow),  # 4 ranks, about 8 s; CI runs it
        pytest.param("fsdp2_every_rank", marks=pytest.mark.slow),  # about 3 s; CI runs it
        pytest.param("hsdp", marks=pytest.mark.slow),  # 4 ranks, about 8 s; CI runs it
        pytest.param("etp2", marks=pytest.mark.slow),  # CI runs it
    ],
)
def test_muon_layouts_match_one_process(tmp_path, muon_reference, layout):
    train(*LAYOUTS[layout], tmp_path)
    assert_same_losses(metrics(tmp_path), muon_reference)


def test_a_muon_checkpoint_resumes_on_another_layout(tmp_path, fsdp2_run):
    """FSDP x 2's step-5 checkpoint (momenta of sharded matrices) continues on EP x 2 (experts' momenta by expert
    over ranks) with the uninterrupted run's losses."""
    straight, _ = fsdp2_run
    (tmp_path / "run").mkdir()
    shutil.copytree(straight / "run" / "step-5", tmp_path / "run" / "step-5")
    first = (straight / "run" / "metrics.jsonl").read_text().splitlines()[:5]
    (tmp_path / "run" / "metrics.jsonl").write_text("\n".join(first) + "\n")
    nproc, args = LAYOUTS["ep2"]
    proc = train(nproc, [*args, *CHECKPOINTED], tmp_path)
    assert "resumed from" in proc.stdout and "at step 5" in proc.stdout
    resumed, expected = metrics(tmp_path), metrics(straight)
    assert [r["step"] for r in resumed] == list(range(1, 11))
    assert_close([r["loss"] for r in resumed[5:]], [r["loss"] for r in expected[5:]], 1e-5)


@pytest.mark.slow  # two runs, about 10 s; CI runs them
def test_muon_on_pp2_matches_one_process(tmp_path, one_process):
    reference = one_process([*MUON, *NO_BALANCE, LOCAL, "8"])
    train(2, [*NO_BALANCE, *PP], tmp_path)
    assert_same_losses(metrics(tmp_path), reference)
