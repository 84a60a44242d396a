"""Qwen3.5 on real layouts (gloo, fp32, block-causal documents): its debug model (three Gated DeltaNet layers, one
gated full-attention layer) gives one process's losses, grad norms and validation losses on FSDP x 2, TP x 2 (the
linear layers split by heads: projections, convolutions, decays) and PP x 2; Qwen3.5-MoE on EP x 2 gives one
process's too, load-balancing term included. Context parallelism: tests/distributed/test_context_parallel.py."""

import pytest
import torch

from tests.distributed.test_context_parallel import (
    assert_cp2_checkpoint_resumes,
    short_documents,  # noqa: F401 (the fixture `documents` asks for)
)
from tests.distributed.test_expert_parallel import LAYOUTS as EP_LAYOUTS
from tests.distributed.test_expert_parallel import assert_same_run
from tests.distributed.test_model_families import LAYOUTS
from tests.helpers import VALIDATED, assert_matches, metrics, train_in_pool
from titanlite.components.hf_weights import save_hf
from titanlite.models.build import build_model
from titanlite.models.common.init import init_weights

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


# Context parallelism's carried state, seen by the whole model. From the debug flavors' own init, a rank that dropped
# the state handed to its tokens moves five steps' losses by about LOSS_RTOL at most (test_context_parallel's Qwen3.5
# CP x 2 block-causal case failed only at step 5, by 1.3e-5, with the bug planted; grad norms within theirs): the
# decays are fast (A = exp(A_log) uniform in [0.01, 16], dt_bias 1: seed 42's slowest head keeps 0.51 of its state a
# token), and above all every linear layer's output norm starts at 0 (init_param's (1 + w) branch takes
# `attention.norm`, a plain weight, before the branch meant to set it to 1), so the linear layers output exactly 0 at
# step 1 and little after. These runs start from those weights with each output norm at 1 (transformers' init) and
# the decays A = SLOW_DECAYS (keeping 0.97 to 0.77 of the state a token), given as a Hugging Face folder: the same
# model and math, only other initial weights. Planting the bug (ContextParallelDeltaRule's `reads` left out) then
# moved both tests' step-1 losses by 2.2e-3 and 2.4e-3 relative, 200 x LOSS_RTOL (the norms at 1 alone: 3e-5 to
# 5e-5; the slow decays alone: under 1e-5 for the CP steps of the resume).
SLOW_DECAYS = [0.02, 0.05, 0.1, 0.2]  # per value head (the debug flavors have 4)
ONE = ["--training.local_batch_size", "8"]  # the global batch of 8 on one process


@pytest.fixture(scope="module")
def documents(request) -> list[str]:
    """test_context_parallel's corpus of short documents (3 to 40 words) and validation on its tail."""
    return request.getfixturevalue("short_documents")


@pytest.fixture(scope="module")
def carrying(tmp_path_factory):
    """carrying(model) -> the arguments that start `model`'s debug flavor (byte tokenizer, the tests' 32 tokens)
    from its seed-42 weights with the linear layers' output norms at 1 and their decays SLOW_DECAYS, saved as a
    Hugging Face folder: weights whose linear layers' carried state shows in the losses."""
    folders: dict[str, list[str]] = {}

    def run(model: str) -> list[str]:
        if model not in folders:
            folder = tmp_path_factory.mktemp(f"{model}_carrying") / "hf"
            decoder = build_model(model, "debug", 257, 32)  # the byte tokenizer's 257 ids (padded), seq_len 32
            init_weights(decoder, seed=42)
            with torch.no_grad():
                for name, param in decoder.named_parameters():
                    if name.endswith("attention.A_log"):
                        param.copy_(torch.tensor(SLOW_DECAYS).log())
                    elif name.endswith("attention.norm.weight"):  # a linear layer's output norm
                        param.fill_(1.0)
            save_hf(folder, decoder.args, decoder.state_dict())
            # The MoE folder as the model itself: as initial weights of the named flavor it is refused for ffn_dim
            # (the flavor's 192, config.json's 32), a width no layer of that flavor (all mixtures) uses.
            moe = model == "qwen3_5_moe"
            folders[model] = ["--model.flavor", "hf", "--model.hf_assets_path", str(folder)] if moe else [
                "--checkpoint.initial_load_path", str(folder)]  # fmt: skip
        return folders[model]

    return run


@pytest.mark.slow  # a 2-rank and a 1-rank run beside the one-process reference, about 25 s
def test_a_qwen3_5_cp2_checkpoint_resumes_on_one_process_with_the_uninterrupted_losses(
    tmp_path, one_process, documents, carrying
):
    """Block-causal short documents (every window crosses documents, and documents cross the ranks' chunks): CP x 2
    saves at step 2, one process resumes there, and steps 3 to 5 are the uninterrupted one-process run's."""
    args = [*QWEN3_5[:2], *documents, *carrying("qwen3_5")]
    whole = one_process([*args, *ONE])
    assert_cp2_checkpoint_resumes(tmp_path, args, whole)


@pytest.mark.slow  # a 4-rank run beside the one-process reference, about 30 s
def test_qwen3_5_moe_on_ep2_x_cp2_matches_one_process(tmp_path, one_process, documents, carrying):
    """Qwen3.5-MoE, block-causal short documents, EP 2 over dp_shard 2 x CP 2: one process's losses, grad norms,
    validation losses, load-balancing terms and expert loads (test_expert_parallel.assert_same_run)."""
    args = [*MOE[:2], *documents, *carrying("qwen3_5_moe")]
    one = one_process([*args, *ONE])
    assert all(r["aux_load_balance"] > 0 for r in one)
    nproc, layout = EP_LAYOUTS["ep2_cp2"]
    proc = train_in_pool(nproc, [*args, *layout], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "layout: dp_shard 2 x cp 2 x ep 2 (of shard x cp) on 4 cpu" in proc.stdout
    assert_same_run(metrics(tmp_path), one)
