"""Multi-token prediction (model.mtp_layers, models/common/multi_token.py) on real layouts (gloo, fp32): DeepSeek-V3's
debug model with one depth (its block a mixture of experts, as DeepSeek's layer 61 is) trains on FSDP x 2, TP x 2, EP x
2, PP x 2 and CP x 2 (GLM-4.5's on TP x 2 and PP x 2) with one process's losses, MTP losses, grad norms, validation
losses and expert loads for the global batch of 8; so does a random DeepSeek-V3 folder's MTP layer (written as
DeepSeek stores layer 61), which the export then writes back, trained, under the folder's names. PP x 2 puts the depth
on the last stage with a copy of the embedding kept equal to the first stage's; CP x 2's ranks each hold 2 chunks of 8
tokens of each sequence, the tokens ahead of a chunk made before the split (the window's last positions, which have
no target ahead, lie on one rank)."""

import pytest
import torch

from tests.distributed.test_context_parallel import cp
from tests.distributed.test_expert_parallel import assert_same_run
from tests.distributed.test_model_families import BANNERS, LAYOUTS
from tests.helpers import VALIDATED, assert_close, assert_matches, metrics, train_in_pool

pytestmark = pytest.mark.distributed

MTP = ["--config", "train_configs/deepseek_v3_debug.toml", "--model.mtp_layers", "1", *VALIDATED]
GLM = ["--config", "train_configs/glm4_moe_debug.toml", "--model.mtp_layers", "1", *VALIDATED]
QWEN = {
    name: ["--config", f"train_configs/{name}_debug.toml", "--model.mtp_layers", "1", *VALIDATED]
    for name in ("qwen3_5", "qwen3_5_moe")
}
EP2 = (2, ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "4"])
CP2 = (2, cp(2))


@pytest.fixture(scope="module")
def mtp_reference(one_process):
    return one_process([*MTP, "--training.local_batch_size", "8"])


def test_multi_token_prediction_logs_its_loss_beside_the_main_one(mtp_reference):
    """The main loss is logged as `loss`, the depth's as mtp_loss, each falling as the model learns."""
    print([(r["loss"], r["mtp_loss"]) for r in mtp_reference])
    assert mtp_reference[-1]["mtp_loss"] < mtp_reference[0]["mtp_loss"]
    assert mtp_reference[-1]["loss"] < mtp_reference[0]["loss"]


@pytest.mark.parametrize(
    "layout",
    [
        "tp2",
        "cp2",
        pytest.param("pp2", marks=pytest.mark.slow),  # a folder's MTP on PP x 2 stays in the default suite (below)
        pytest.param("fsdp2", marks=pytest.mark.slow),
        pytest.param("ep2", marks=pytest.mark.slow),
    ],
)
def test_multi_token_prediction_on_a_layout_matches_one_process(tmp_path, mtp_reference, layout):
    nproc, args = {"ep2": EP2, "cp2": CP2, **LAYOUTS}[layout]
    proc = train_in_pool(nproc, [*MTP, *args], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert f"layout: {BANNERS[layout]} on 2 cpu" in proc.stdout
    assert "multi-token prediction: 1 depth(s) after layer 2" in proc.stdout
    records = metrics(tmp_path)
    assert_same_run(records, mtp_reference)
    assert_close([r["mtp_loss"] for r in records], [r["mtp_loss"] for r in mtp_reference], 1e-5)


@pytest.mark.slow  # four 2-rank runs beside two one-process references, about 25 s: CI runs them
@pytest.mark.parametrize(
    "family, layout", [("glm4_moe", "tp2"), ("glm4_moe", "pp2"), ("qwen3_5_moe", "tp2"), ("qwen3_5", "pp2")]
)
def test_glm4_5_and_qwen3_5_multi_token_prediction_on_a_layout_matches_one_process(
    tmp_path, one_process, family, layout
):
    """GLM-4.5's debug model (QKV biases, per-head Q/K norms, partial rotary) and Qwen3.5's (Gated DeltaNet layers, a
    gated full-attention block for the depth, (1 + w) norms; Qwen3.5-MoE's on TP, whose PP x 2 differs from one
    process by 2e-5 without MTP too: its pooled balance term is per pipeline micro-batch) with one depth: its block has
    the family's TP plan, and PP puts it on the last stage."""
    run = {"glm4_moe": GLM, **QWEN}[family]
    reference = one_process([*run, "--training.local_batch_size", "8"])
    nproc, args = LAYOUTS[layout]
    proc = train_in_pool(nproc, [*run, *args], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "multi-token prediction: 1 depth(s) after layer 3" in proc.stdout
    records = metrics(tmp_path)
    (assert_same_run if "expert_load" in reference[0] else assert_matches)(records, reference)
    assert_close([r["mtp_loss"] for r in records], [r["mtp_loss"] for r in reference], 1e-5)


@pytest.mark.slow  # a 2-rank run beside its one-process reference, about 5 s: CI runs it
def test_two_depths_on_context_parallelism_match_one_process(tmp_path, one_process):
    """Two depths: the second's targets are two places further, so the window's last two positions have none, and
    each CP rank weighs its own share of both depths' targets."""
    run = [*MTP[:2], "--model.mtp_layers", "2", *VALIDATED]
    reference = one_process([*run, "--training.local_batch_size", "8"])
    nproc, args = CP2
    proc = train_in_pool(nproc, [*run, *args], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    records = metrics(tmp_path)
    assert_same_run(records, reference)
    for depth in ("mtp_loss_1", "mtp_loss_2"):
        assert_close([r[depth] for r in records], [r[depth] for r in reference], 1e-5)


@pytest.fixture(scope="module")
def deepseek_mtp_folder(tmp_path_factory):
    """A random DeepSeek-V3 folder with an MTP layer written as DeepSeek stores layer 61
    (tests/unit/test_multi_token_prediction.py mtp_folder), and the layer's tensors."""
    pytest.importorskip("transformers", reason="transformers is an optional test dependency (pip install .[hf])")
    from tests.unit.test_multi_token_prediction import mtp_folder

    folder = tmp_path_factory.mktemp("deepseek_mtp") / "hf"
    _, mtp, _ = mtp_folder(folder)
    return folder, mtp


def folder_run(folder) -> list[str]:
    return ["--model.flavor", "hf", "--model.hf_assets_path", str(folder), "--model.tokenizer", "byte", *VALIDATED]


@pytest.mark.parametrize(
    "layout",
    [
        "pp2",
        pytest.param("fsdp2", marks=pytest.mark.slow),
        pytest.param("tp2", marks=pytest.mark.slow),
        pytest.param("ep2", marks=pytest.mark.slow),
        pytest.param("cp2", marks=pytest.mark.slow),
    ],
)
def test_a_deepseek_v3_folder_s_mtp_layer_trains_on_a_layout_as_on_one_process_and_exports_back(
    tmp_path, one_process, deepseek_mtp_folder, cli, layout
):
    """The folder's MTP layer, its embedding and head shared, trains on the layout with one process's main and MTP
    losses; the export writes it back under the folder's names, trained (PP x 2: its copy of the embedding on the
    last stage read from the folder too)."""
    folder, mtp = deepseek_mtp_folder
    reference = one_process([*folder_run(folder), "--training.local_batch_size", "8"])
    nproc, args = {"ep2": EP2, "cp2": CP2, **LAYOUTS}[layout]
    checkpointed = ["--checkpoint.enable", "--checkpoint.interval", "5"]
    proc = train_in_pool(nproc, [*folder_run(folder), *args, *checkpointed], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "multi-token prediction: 1 depth(s) after layer 2" in proc.stdout
    assert "hold 2 copies of the embedding and head, equal to the model's" in proc.stdout
    records = metrics(tmp_path)
    assert_same_run(records, reference)
    assert_close([r["mtp_loss"] for r in records], [r["mtp_loss"] for r in reference], 1e-5)
    done = cli(
        "convert",
        "to-hf",
        "--output",
        str(tmp_path / "export"),
        "--job.dump_folder",
        str(tmp_path),
        "--job.name",
        "run",
    )
    assert done.returncode == 0, done.stderr
    from safetensors.torch import load_file

    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert {name: value.shape for name, value in exported.items() if name in mtp} == {
        n: v.shape for n, v in mtp.items()
    }
    assert not torch.equal(exported["model.layers.3.eh_proj.weight"], mtp["model.layers.3.eh_proj.weight"])  # trained
    assert torch.equal(exported["model.layers.3.embed_tokens.weight"], exported["model.embed_tokens.weight"])
