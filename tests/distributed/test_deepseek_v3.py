"""DeepSeek-V3 (gloo, fp32) on expert parallelism gives one process's losses, grad norms and expert loads, alone
(EP x 2, EP x 4) and beside tensor parallelism (latent attention split by heads), context parallelism and
pipeline parallelism; its
routing biases (the bias method, the family's default) move alike; a checkpoint saved at EP x 2 resumes at EP x 4
and at EP x 1 with the same losses.

Every run takes micro-batches of 2 sequences (a global batch of 8), as the one-process reference accumulates them."""

import shutil

import pytest
import torch

from tests.helpers import TINY, assert_close, assert_matches, checkpoint_tensors, metrics, train_in_pool

pytestmark = pytest.mark.distributed

RUN = [
    "--config",
    "train_configs/deepseek_v3_debug.toml",
    *TINY,
    "--training.global_batch_size",
    "8",
    "--training.local_batch_size",
    "2",
    "--moe.bias_update_rate",
    "0.01",  # biases that move enough to change the routing within the run
]
CHECKPOINTED = ["--checkpoint.enable", "--checkpoint.interval", "3"]
EP = "--parallelism.expert_parallel_degree"
LAYOUTS = {
    "ep4": (4, [EP, "4"]),
    "ep2_tp2": (4, [EP, "2", "--parallelism.tensor_parallel_degree", "2"]),
    "ep2_cp2": (4, [EP, "2", "--parallelism.context_parallel_degree", "2"]),
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
    proc = train_in_pool(nproc, [*RUN, *args], run_dir)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def assert_same_run(records, reference):
    assert_matches(records, reference)
    assert "aux_load_balance" not in records[0]  # balanced by the biases, no auxiliary loss
    assert_close([r["expert_load"] for r in records], [r["expert_load"] for r in reference], 1e-6)


def biases(run_dir, step: int) -> dict[str, torch.Tensor]:
    tensors = checkpoint_tensors(run_dir / "run" / f"step-{step}", run_dir)
    return {name: t for name, t in tensors.items() if name.endswith("expert_bias")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single")
    train(1, CHECKPOINTED, run_dir)
    return run_dir


@pytest.fixture(scope="module")
def ep2(tmp_path_factory):
    """EP x 2 on 2 ranks (each holds 4 of the 8 experts), checkpointed at steps 3 and 5."""
    run_dir = tmp_path_factory.mktemp("ep2")
    proc = train(2, [EP, "2", *CHECKPOINTED], run_dir)
    return run_dir, proc


@pytest.mark.slow  # two runs, about 20 s, beside a default suite near its 15 minutes: CI runs it
def test_ep2_matches_one_process_losses_loads_and_biases(reference, ep2):
    run_dir, proc = ep2
    assert "ep 2 (of shard x cp)" in proc.stdout and "model deepseek_v3 debug" in proc.stdout
    assert_same_run(metrics(run_dir), metrics(reference))
    ours, expected = biases(run_dir, 5), biases(reference, 5)
    assert ours.keys() == expected.keys() and len(expected) == 2  # layers 1 and 2 (layer 0 is dense)
    for name, bias in expected.items():
        assert bias.abs().sum() > 0, name
        torch.testing.assert_close(ours[name], bias, rtol=0, atol=0)


@pytest.mark.slow  # four 4-rank runs, about a minute: CI runs them
@pytest.mark.parametrize("layout", LAYOUTS)
def test_expert_parallel_layouts_match_one_process(tmp_path, reference, layout):
    nproc, args = LAYOUTS[layout]
    train(nproc, args, tmp_path)
    assert_same_run(metrics(tmp_path), metrics(reference))


@pytest.mark.slow  # two runs, about 30 s: CI runs them
@pytest.mark.parametrize("nproc, ep", [(2, 1), (4, 4)])
def test_an_ep2_checkpoint_resumes_on_another_ep_degree(tmp_path, ep2, nproc, ep):
    """The EP x 2 run's step-3 checkpoint (routing biases included) continues on EP x 1 and EP x 4."""
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
    assert_close([r["expert_load"] for r in resumed[3:]], [r["expert_load"] for r in expected[3:]], 1e-6)


@pytest.mark.slow  # three 2-rank runs, about 18 s: CI runs them
@pytest.mark.parametrize("layout", ["ep2", "tp2", "tp2_etp2"])
def test_a_deepseek_v3_folder_imports_on_a_layout_with_transformers_logits(tmp_path, layout):
    """EP x 2 (experts stacked from their tensors and sharded, every other weight FSDP-sharded), TP x 2 (the
    per-head projections split by heads) or TP x 2 with the experts split over it (each expert's tensors cut on
    their width): each rank reads the folder one tensor at a time, the routing biases too, and the forward gives
    transformers' logits."""
    pytest.importorskip("transformers")
    from tests.conformance import assert_logits_match
    from tests.distributed.test_hf_layouts import layout_logits
    from tests.unit.test_deepseek_v3 import VOCAB, random_deepseek

    hf = random_deepseek()
    hf.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    tokens = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(4))
    ours = layout_logits(tmp_path / "hf", tokens, layout)
    with torch.no_grad():
        assert_logits_match(ours, hf(tokens).logits)


@pytest.mark.slow  # two runs, about 12 s: CI runs them
def test_the_per_layer_balance_loss_on_ep2_is_one_processs(tmp_path):
    """With moe.balance = "aux_loss" each MoE block adds its own Switch term, a product of means over the
    micro-batch's tokens: each block sums its statistics over the ranks that hold the rest of the micro-batch, so
    EP x 2 at 4 sequences a rank gives one process's losses and term at 8 (a rank's own 4 gave another term)."""
    aux = [*RUN[: RUN.index("--moe.bias_update_rate")], "--moe.balance", "aux_loss", "--moe.aux_loss_coef", "0.1"]
    local = "--training.local_batch_size"
    layouts = {"single": (1, [local, "8"]), "ep2": (2, [EP, "2", local, "4"])}
    for name, (nproc, args) in layouts.items():  # the global batch of 8 as one micro-batch
        proc = train_in_pool(nproc, [*aux, *args], tmp_path / name)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    ours, expected = metrics(tmp_path / "ep2"), metrics(tmp_path / "single")
    assert_matches(ours, expected)
    assert_close([r["aux_load_balance"] for r in ours], [r["aux_load_balance"] for r in expected], 1e-5)


ETP = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_tensor_parallel_degree", "2"]


@pytest.fixture(scope="module")
def tp2_etp2(tmp_path_factory):
    """TP x 2 with EP 1, the experts split over the two TP ranks (TorchTitan's 671B layout in little),
    checkpointed at steps 3 and 5."""
    run_dir = tmp_path_factory.mktemp("tp2_etp2")
    proc = train(2, [*ETP, *CHECKPOINTED], run_dir)
    return run_dir, proc


@pytest.mark.slow  # two 2-rank runs and a one-process reference, about 25 s: CI runs them
def test_experts_split_over_tp_match_one_process_and_resume_on_ep2(tmp_path, reference, tp2_etp2):
    """TP x 2, ETP 2: every rank routes the same tokens and computes half of each expert's width (and of the shared
    expert's); the partial outputs summed give one process's losses, grad norms and expert loads. Its step-3
    checkpoint (experts sharded on their width) continues on EP x 2 (sharded by expert) with the same losses."""
    run_dir, proc = tp2_etp2
    assert "tp 2 x etp 2 (experts split over tp)" in proc.stdout
    assert_same_run(metrics(run_dir), metrics(reference))
    (tmp_path / "run").mkdir()
    shutil.copytree(run_dir / "run" / "step-3", tmp_path / "run" / "step-3")
    first = (run_dir / "run" / "metrics.jsonl").read_text().splitlines()[:3]
    (tmp_path / "run" / "metrics.jsonl").write_text("\n".join(first) + "\n")
    proc = train(2, [EP, "2", *CHECKPOINTED], tmp_path)
    assert "resumed from" in proc.stdout and "at step 3" in proc.stdout
    resumed, expected = metrics(tmp_path), metrics(run_dir)
    assert_close([r["loss"] for r in resumed[3:]], [r["loss"] for r in expected[3:]], 1e-5)
    assert_close([r["expert_load"] for r in resumed[3:]], [r["expert_load"] for r in expected[3:]], 1e-6)


@pytest.mark.slow  # two 4-rank runs, about 18 s: CI runs them
@pytest.mark.parametrize(
    "layout, args",
    [
        # EP 2 x TP 2: each block's experts on the 2-D (ep, tp) mesh, 4 experts an ep rank, each split over its 2 tp
        # ranks, the tokens dispatched over ep
        ("ep 2 (of shard x cp) x etp 2", [EP, "2"]),
        # FSDP 2 x TP 2, EP 1 (TorchTitan's DeepSeek-V3 671B layout in little): FSDP shards the split experts on
        # dim 0 over dp_shard, as it does the TP-split dense weights
        ("dp_shard 2 x tp 2 x etp 2", []),
    ],
)
def test_experts_split_over_tp_beside_ep_or_fsdp_match_one_process(tmp_path, reference, layout, args):
    proc = train(4, [*args, *ETP], tmp_path)
    assert f"{layout} (experts split over tp)" in proc.stdout
    assert_same_run(metrics(tmp_path), metrics(reference))
