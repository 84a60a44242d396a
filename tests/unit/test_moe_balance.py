"""The [moe] section and the MoE step hook: the keys override the flavor's balancing and are refused in one line
where they cannot act; a resume may change the coefficients but not the balance; a training forward's counts
join the step's once (activation checkpointing included); the hook moves the biases by the step's counts and
keeps the worst block's load on the device; a short CPU run of the bias method logs the expert load and a
resumed one gives the uninterrupted run's losses (its biases restored)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import TINY, checkpoint_tensors, losses, metrics, train_in_pool
from titanlite.base.errors import ConfigError
from titanlite.builder.plan import ModelPlan
from titanlite.builder.run import run_facts
from titanlite.components.expert_balance import ExpertBalance
from titanlite.components.resume import flat_config, resume_changes
from titanlite.config import parse_config
from titanlite.models.build import configured_args, configured_model, model_from_args
from titanlite.models.common.init import init_weights
from titanlite.models.common.moe.layer import GroupedExperts, MoE, expert_load

MOE_CONFIG = ["--config", "train_configs/qwen3_moe_debug.toml"]


def resolved(*argv: str):
    cfg = parse_config([*MOE_CONFIG, *argv])
    return configured_args(cfg.model, 300, 64, cfg.moe).moe


def test_the_moe_keys_override_the_flavor_s_balancing():
    flavor = resolved()
    assert (flavor.balance, flavor.bias_update_rate) == ("aux_loss", 0.001)
    bias = resolved("--moe.balance", "bias", "--moe.bias_update_rate", "0.01", "--moe.z_loss_coef", "0.002")
    assert (bias.balance, bias.bias_update_rate, bias.z_loss_coef) == ("bias", 0.01, 0.002)
    assert dataclasses.replace(bias, balance="aux_loss", bias_update_rate=0.001, z_loss_coef=0.0) == flavor
    assert resolved("--moe.aux_loss_coef", "0").aux_loss_coef == 0.0


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--moe.balance", "bias"],
            "moe.balance='bias' is set but model gpt2 has no mixture-of-experts blocks: it applies only with a "
            "mixture-of-experts model; use a model with experts (e.g. --config train_configs/qwen3_moe_debug.toml), "
            "or remove moe.balance",
        ),
        (
            ["--moe.z_loss_coef", "0.1"],
            "moe.z_loss_coef=0.1 is set but model gpt2 has no mixture-of-experts blocks",
        ),
        (
            [*MOE_CONFIG, "--moe.balance", "bias", "--moe.aux_loss_coef", "0.01"],
            "moe.aux_loss_coef=0.01 is set but the balance is 'bias': it applies only with moe.balance = 'aux_loss' "
            "(the flavor's or set); set moe.balance = 'aux_loss', or remove moe.aux_loss_coef",
        ),
        (
            [*MOE_CONFIG, "--moe.bias_update_rate", "0.01"],
            "moe.bias_update_rate=0.01 is set but the balance is 'aux_loss'",
        ),
        (
            [*MOE_CONFIG, "--moe.balance", "loss"],
            "moe.balance='loss' is not allowed; use one of: '', 'aux_loss', 'bias', 'none'",
        ),
        (
            [*MOE_CONFIG, "--moe.bias_update_rate", "-0.5"],
            "moe.bias_update_rate=-0.5 must be at least 0, or -1 to keep the model flavor's",
        ),
    ],
)
def test_keys_that_cannot_act_are_refused_in_one_line(argv, message):
    with pytest.raises(ConfigError) as error:
        cfg = parse_config(argv)
        configured_args(cfg.model, 300, 64, cfg.moe)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def facts_of(*argv: str) -> tuple:
    cfg = parse_config([*MOE_CONFIG, *argv])
    model = ModelPlan.of(cfg, SimpleNamespace(vocab_size=300, fingerprint="t"))
    return cfg, run_facts(model, SimpleNamespace(windows=[0] * 7))


def test_a_resume_may_change_the_coefficients_but_not_the_balance():
    saved_cfg, saved = facts_of("--moe.balance", "bias")
    cfg, facts = facts_of("--moe.balance", "bias", "--moe.bias_update_rate", "0.01", "--moe.z_loss_coef", "0.1")
    changes = resume_changes(flat_config(saved_cfg), saved, cfg, facts, set(), "step-5")
    assert changes == ["moe.z_loss_coef -1.0 -> 0.1", "moe.bias_update_rate -1.0 -> 0.01"]
    for argv in ([], ["--moe.balance", "aux_loss"]):  # the flavor's balance, or named: what counts is the model's
        cfg, facts = facts_of(*argv)
        with pytest.raises(ConfigError, match=r"^moe.balance is 'aux_loss', not the 'bias' that step-5 was saved"):
            resume_changes(flat_config(saved_cfg), saved, cfg, facts, set(), "step-5")
        assert resume_changes(flat_config(saved_cfg), saved, cfg, facts, {"model", "optimizer"}, "step-5")


def bias_model(**moe):
    args = configured_args(parse_config(MOE_CONFIG).model, 320, 64)
    args = dataclasses.replace(args, moe=dataclasses.replace(args.moe, balance="bias", **moe))
    model = model_from_args(args)
    init_weights(model, 0)
    model.init_buffers()
    return model


def blocks(model) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def test_a_training_forward_counts_once_even_when_backward_recomputes_it():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = bias_model()
    for i in list(model.layers):
        model.layers[i] = checkpoint_wrapper(model.layers[i], preserve_rng_state=False)
    x = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # two micro-batches of one step
        model(x).float().square().mean().backward()
    for block in blocks(model):
        assert block.step_tokens.sum() == 2 * 2 * 16 * block.args.top_k
        assert torch.equal(block.step_tokens, 2 * block.tokens_per_expert)  # the same tokens twice
    with torch.no_grad():
        model(x)  # evaluation: not counted
    assert all(block.step_tokens.sum() == 2 * 2 * 16 * block.args.top_k for block in blocks(model))


def test_a_forward_differentiated_for_its_inputs_only_is_not_counted():
    # What a pipeline stage's shape inference does (torch 2.13 runs a real forward, then torch.autograd.grad with
    # inputs= the stage's inputs): the weights' branches are left out, so the step's counts stay as they were.
    # Nothing patches the stage: the block counts on the backward that reaches its experts' weights.
    model = bias_model()
    x = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(1))
    h = model.tok_embeddings(x).detach().requires_grad_()
    model.tok_embeddings = None  # a later stage's part: hidden states in
    out = model(h)
    (grad,) = torch.autograd.grad(out.float().square().mean(), inputs=[h])
    assert grad.abs().sum() > 0
    assert all(block.step_tokens.sum() == 0 for block in blocks(model))
    model(h).float().square().mean().backward()  # the training backward of the same micro-batch counts it once
    assert all(block.step_tokens.sum() == 2 * 16 * block.args.top_k for block in blocks(model))


def test_the_hook_moves_each_bias_by_the_step_s_counts_and_keeps_the_worst_load():
    model = bias_model(bias_update_rate=0.01)
    moe_blocks = blocks(model)
    counts = [torch.tensor([8, 0, 0, 0, 0, 0, 0, 0]), torch.tensor([1, 1, 1, 1, 1, 1, 1, 1])]
    for block, c in zip(moe_blocks, counts):
        block.step_tokens.copy_(c)
    hook = ExpertBalance([model], torch.device("cpu"), None, None)
    hook(1)
    assert torch.equal(moe_blocks[0].router.expert_bias, 0.01 * torch.tensor([-1.0, 1, 1, 1, 1, 1, 1, 1]))
    assert torch.equal(moe_blocks[1].router.expert_bias, torch.zeros(8))  # balanced: no move
    assert hook.load is not None and hook.load.item() == 8.0 == expert_load(counts[0])  # the worst block's
    assert all(block.step_tokens.sum() == 0 for block in moe_blocks)  # the next step starts afresh


BIAS_RUN = [
    *MOE_CONFIG,
    *TINY,
    "--training.steps",
    "4",
    "--moe.balance",
    "bias",
    "--moe.bias_update_rate",
    "0.01",
    "--checkpoint.enable",
    "true",
    "--checkpoint.interval",
    "2",
]


def test_the_bias_method_moves_the_biases_and_logs_the_expert_load(tmp_path):
    whole = train_in_pool(1, BIAS_RUN, tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    records = metrics(tmp_path)
    assert all(r["expert_load"] >= 1 for r in records) and " expert_load " in whole.stdout
    biases = {k: v for k, v in checkpoint_tensors(tmp_path / "run/step-4", tmp_path).items() if "bias" in k}
    assert len(biases) == len(blocks(bias_model())) == 3  # the debug flavor's MoE blocks (layer 1 is dense)
    assert all(v.abs().sum() > 0 for v in biases.values())


@pytest.mark.slow  # three runs, about 25 s
def test_a_resumed_bias_run_gives_the_uninterrupted_run_s_losses(tmp_path):
    """The same run stopped after step 2 and resumed gives the same losses: the routing biases (buffers in the
    checkpoint) are restored, or steps 3 and 4 would route other tokens."""
    expected = losses(train_in_pool(1, BIAS_RUN, tmp_path / "whole"), tmp_path / "whole")
    stopped = train_in_pool(1, [*BIAS_RUN, "--training.stop_after_step", "2"], tmp_path / "split")
    assert losses(stopped, tmp_path / "split") == expected[:2]
    resumed = train_in_pool(1, BIAS_RUN, tmp_path / "split")
    assert losses(resumed, tmp_path / "split") == pytest.approx(expected, rel=1e-6)


def test_the_loop_kernel_switch_reaches_every_blocks_experts_and_changes_no_number():
    cfg = parse_config([*MOE_CONFIG, "--moe.experts_kernel", "loop"])
    torch.manual_seed(0)
    loop = configured_model(cfg.model, 300, 64, cfg.moe)
    auto = configured_model(cfg.model, 300, 64, parse_config(MOE_CONFIG).moe)
    init_weights(loop, seed=1)
    init_weights(auto, seed=1)
    kernels = {m.use_grouped_mm for m in loop.modules() if isinstance(m, GroupedExperts)}
    assert kernels == {False} and {m.use_grouped_mm for m in auto.modules() if isinstance(m, GroupedExperts)} == {None}
    tokens = torch.randint(0, 300, (2, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(loop(tokens), auto(tokens), rtol=0, atol=1e-5)
    with pytest.raises(ConfigError, match="^moe.experts_kernel='loop' is set but model gpt2 has no mixture-of-experts"):
        configured_args(parse_config(["--moe.experts_kernel", "loop"]).model, 300, 64, cfg.moe)
