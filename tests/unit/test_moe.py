"""The shared mixture-of-experts block (titanlite/models/common/moe/layer.py) computes what transformers' sparse MoE
blocks compute (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE with its gated shared expert) from the same weights, under
Hugging Face's tensor names both ways; its load-balancing loss and router z-loss are transformers' and ST-MoE's;
the grouped-GEMM path equals the loop over experts and reads nothing on the host; the balancing bias steers the
choice of experts, never their weights; the arguments refuse what cannot work with a one-line message."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from tests.helpers import REPO
from titanlite.models.common.auxiliary import AuxiliaryLosses, collecting
from titanlite.models.common.moe import layer as moe_module
from titanlite.models.common.moe.args import MoEArgs, dense_layers_from_hf
from titanlite.models.common.moe.layer import (
    MoE,
    expert_load,
    grouped_mm_runs,
    load_balancing_loss,
    moe_from_hf,
    moe_to_hf,
    router_z_loss,
    update_balance_bias,
)
from titanlite.tools.host_reads import count_host_reads

try:
    from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig
    from transformers.models.mixtral import modeling_mixtral
    from transformers.models.olmoe import modeling_olmoe
    from transformers.models.qwen2_moe import modeling_qwen2_moe
    from transformers.models.qwen3_moe import modeling_qwen3_moe
    from transformers.models.switch_transformers import modeling_switch_transformers
except ImportError:  # the block's own tests still run
    modeling_qwen3_moe = None
needs_transformers = pytest.mark.skipif(
    modeling_qwen3_moe is None, reason="transformers is an optional test dependency (pip install .[hf])"
)

DIM, HIDDEN, SHARED, EXPERTS, TOP_K = 16, 24, 32, 8, 2
GROUPED_REASON = "torch._grouped_mm does not run for float32 on this device and torch"


def hf_block(family: str, norm_topk_prob: bool = True):
    """transformers' sparse MoE block of `family`, tiny, random weights; and our arguments for the same block."""
    common = dict(hidden_size=DIM, num_experts_per_tok=TOP_K)
    if family == "qwen3_moe":
        config = Qwen3MoeConfig(
            **common, moe_intermediate_size=HIDDEN, num_experts=EXPERTS, norm_topk_prob=norm_topk_prob
        )
        block, args = (
            modeling_qwen3_moe.Qwen3MoeSparseMoeBlock,
            MoEArgs(EXPERTS, TOP_K, HIDDEN, norm_topk_prob=norm_topk_prob),
        )
    elif family == "mixtral":  # Mixtral always renormalises its top-k
        config = MixtralConfig(**common, intermediate_size=HIDDEN, num_local_experts=EXPERTS)
        block, args = modeling_mixtral.MixtralSparseMoeBlock, MoEArgs(EXPERTS, TOP_K, HIDDEN, norm_topk_prob=True)
    elif family == "olmoe":
        config = OlmoeConfig(**common, intermediate_size=HIDDEN, num_experts=EXPERTS, norm_topk_prob=norm_topk_prob)
        block, args = modeling_olmoe.OlmoeSparseMoeBlock, MoEArgs(EXPERTS, TOP_K, HIDDEN, norm_topk_prob=norm_topk_prob)
    else:
        config = Qwen2MoeConfig(
            **common,
            moe_intermediate_size=HIDDEN,
            shared_expert_intermediate_size=SHARED,
            num_experts=EXPERTS,
            norm_topk_prob=norm_topk_prob,
        )
        block = modeling_qwen2_moe.Qwen2MoeSparseMoeBlock
        args = MoEArgs(
            EXPERTS, TOP_K, HIDDEN, norm_topk_prob=norm_topk_prob, shared_expert_dim=SHARED, shared_gate=True
        )
    config._experts_implementation = "eager"  # transformers' reference loop over the experts
    torch.manual_seed(0)
    hf = block(config)
    for p in hf.parameters():  # the routers start at zero or uninitialised: any fixed values do
        torch.nn.init.normal_(p, std=0.3)
    return hf, args


def ours_from(hf, args: MoEArgs, use_grouped_mm: bool | None = None, **changes) -> MoE:
    args = dataclasses.replace(args, **changes)
    moe = MoE(DIM, args, use_grouped_mm=use_grouped_mm)
    moe.load_state_dict(moe_from_hf(hf.state_dict(), args.n_experts))
    return moe


def our_block(use_grouped_mm: bool | None = None, **changes) -> MoE:
    """Our block alone (no transformers), with Qwen2-MoE's gated shared expert, random weights."""
    args = dataclasses.replace(MoEArgs(EXPERTS, TOP_K, HIDDEN, shared_expert_dim=SHARED, shared_gate=True), **changes)
    torch.manual_seed(0)
    moe = MoE(DIM, args, use_grouped_mm=use_grouped_mm)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return moe


def same_weights(moe: MoE, use_grouped_mm: bool | None) -> MoE:
    twin = MoE(DIM, moe.args, use_grouped_mm=use_grouped_mm)
    twin.load_state_dict(moe.state_dict())
    return twin


def tokens(b: int = 3, t: int = 7) -> torch.Tensor:
    return torch.randn(b, t, DIM, generator=torch.Generator().manual_seed(1))


FAMILIES = ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe"]


@needs_transformers
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("path", ["auto", "loop"])
def test_the_block_computes_what_transformers_block_computes(family, path):
    hf, args = hf_block(family)
    moe = ours_from(hf, args, use_grouped_mm=None if path == "auto" else False)
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(moe(x), hf(x), rtol=0, atol=1e-5)
        routing = moe.router(x.view(-1, DIM))
        hf_logits, hf_weights, hf_indices = hf.gate(x.view(-1, DIM))
    torch.testing.assert_close(routing.logits, hf_logits.float(), rtol=0, atol=1e-6)
    assert torch.equal(routing.indices, hf_indices)
    torch.testing.assert_close(routing.weights, hf_weights.float(), rtol=0, atol=1e-6)


@needs_transformers
@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_without_renormalisation_the_weights_are_the_softmax_probabilities(family):
    hf, args = hf_block(family, norm_topk_prob=False)
    moe = ours_from(hf, args)
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(moe(x), hf(x), rtol=0, atol=1e-5)
        routing = moe.router(x.view(-1, DIM))
    assert (routing.weights.sum(-1) < 1).all()  # two of eight probabilities, not renormalised


@needs_transformers
def test_route_scale_scales_the_routed_experts_only():
    hf, args = hf_block("qwen2_moe")
    plain, scaled = ours_from(hf, args), ours_from(hf, args, route_scale=2.5)
    x = tokens()
    with torch.no_grad():
        shared = torch.sigmoid(plain.shared_gate(x)) * plain.shared_expert(x)
        torch.testing.assert_close(scaled(x) - shared, 2.5 * (plain(x) - shared), rtol=0, atol=1e-5)


@needs_transformers
@pytest.mark.parametrize("names", ["gate_proj", "w1"])
def test_hugging_face_checkpoint_names_both_ways(names):
    """Hub files hold one tensor per expert (Mixtral's w1/w3/w2, the others' gate_proj/up_proj/down_proj);
    transformers 5 stacks them in memory as gate_up_proj (gate rows first) and down_proj."""
    hf, args = hf_block("qwen2_moe")
    from_stacked = moe_from_hf(hf.state_dict(), EXPERTS)
    files = moe_to_hf(from_stacked, names=names)
    assert f"experts.{EXPERTS - 1}.{'w2' if names == 'w1' else 'down_proj'}.weight" in files
    assert files["experts.3.up_proj.weight" if names == "gate_proj" else "experts.3.w3.weight"].shape == (HIDDEN, DIM)
    from_files = moe_from_hf(files, EXPERTS)
    assert from_files.keys() == from_stacked.keys() == MoE(DIM, args).state_dict().keys()
    for name, t in from_stacked.items():
        assert torch.equal(from_files[name], t), name
    gate_up = hf.experts.gate_up_proj.detach()
    assert torch.equal(from_stacked["experts.w1"][2], gate_up[2, :HIDDEN])
    assert torch.equal(from_stacked["experts.w3"][2], gate_up[2, HIDDEN:])


def collect_terms(moe: MoE, x: torch.Tensor) -> dict[str, torch.Tensor]:
    terms = AuxiliaryLosses(("load_balance", "router_z"))
    terms.watch(moe)
    with collecting(terms):
        moe(x).sum().backward()
    return dict(zip(terms.names, terms.take(torch.device("cpu"), passes=1)))


@needs_transformers
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_the_load_balancing_loss_is_transformers_for_a_batch(family):
    hf, args = hf_block(family)
    moe = ours_from(hf, args, aux_loss_coef=0.01)
    x = tokens(4, 9)
    logits = hf.gate(x.view(-1, DIM))[0].detach()
    balancing_loss = (modeling_qwen3_moe if family == "qwen3_moe" else modeling_mixtral).load_balancing_loss_func
    expected = balancing_loss((logits,), EXPERTS, TOP_K)
    route = moe.router(x.view(-1, DIM))
    direct = load_balancing_loss(route.scores, route.indices, moe_counts(moe, x), args)
    torch.testing.assert_close(direct, expected, rtol=0, atol=1e-6)
    logged = collect_terms(moe, x)
    torch.testing.assert_close(logged["load_balance"], 0.01 * expected, rtol=0, atol=1e-7)
    assert logged["router_z"] == 0  # z_loss_coef 0: not added
    assert moe.router.gate.weight.grad is not None


def moe_counts(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        moe(x)
    return moe.tokens_per_expert


@needs_transformers
def test_the_router_z_loss_is_st_moe_s_mean_squared_logsumexp():
    hf, args = hf_block("olmoe")
    moe = ours_from(hf, args, balance="none", z_loss_coef=0.001)
    x = tokens()
    logits = moe.router(x.view(-1, DIM)).logits.detach()
    expected = modeling_switch_transformers.router_z_loss_func(
        logits[None]
    )  # transformers' (Switch Transformers') definition, [groups, tokens, E]
    torch.testing.assert_close(router_z_loss(logits), expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(router_z_loss(logits), logits.logsumexp(-1).pow(2).mean(), rtol=0, atol=1e-6)
    logged = collect_terms(moe, x)
    torch.testing.assert_close(logged["router_z"], 0.001 * expected, rtol=0, atol=1e-8)
    assert logged["load_balance"] == 0  # balance="none"


@needs_transformers
def test_outside_a_training_step_no_term_is_added():
    hf, args = hf_block("qwen3_moe")
    moe = ours_from(hf, args, z_loss_coef=0.1)
    x = tokens()
    out = moe(x)  # nothing collects: the output is the block's alone
    with torch.no_grad():
        torch.testing.assert_close(out, hf(x), rtol=0, atol=1e-5)


@pytest.mark.skipif(not grouped_mm_runs(torch.device("cpu"), torch.float32), reason=GROUPED_REASON)
def test_the_grouped_path_equals_the_loop_forward_and_backward():
    grouped = our_block(use_grouped_mm=True)
    loop = same_weights(grouped, use_grouped_mm=False)
    x = tokens(4, 9)
    for moe in (grouped, loop):
        torch.testing.assert_close(grouped(x), loop(x), rtol=0, atol=1e-6)
        (moe(x) * torch.linspace(-1, 1, DIM)).sum().backward()
    for (name, p), q in zip(grouped.named_parameters(), loop.parameters()):
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6)


@pytest.mark.parametrize("use_grouped_mm", [None, True])
def test_experts_sent_no_rows_return_no_rows_and_zero_gradients(use_grouped_mm):
    """An expert-parallel rank may receive no token at all; torch._grouped_mm's backward refuses zero rows."""
    experts = our_block(use_grouped_mm=use_grouped_mm).experts
    out = experts(torch.zeros(0, DIM, requires_grad=True), torch.zeros(EXPERTS, dtype=torch.int64))
    assert out.shape == (0, DIM)
    out.sum().backward()
    for name, p in experts.named_parameters():
        assert p.grad is not None and not p.grad.any(), name


@pytest.mark.skipif(not grouped_mm_runs(torch.device("cpu"), torch.bfloat16), reason=GROUPED_REASON)
def test_under_autocast_the_grouped_path_runs_in_its_dtype_as_the_loop_does():
    grouped = our_block(use_grouped_mm=True)
    loop = same_weights(grouped, use_grouped_mm=False)
    x = tokens()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, expected = grouped(x), loop(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    auto = same_weights(grouped, use_grouped_mm=None).experts
    assert auto.grouped(x.bfloat16()) and not auto.grouped(x.double())  # float64: torch._grouped_mm refuses it
    with torch.no_grad():
        assert (out - grouped(x)).abs().max() > 1e-4  # float32 outside autocast: not the same numbers


@pytest.mark.skipif(not grouped_mm_runs(torch.device("cpu"), torch.float32), reason=GROUPED_REASON)
def test_the_grouped_path_reads_nothing_on_the_host():
    moe = our_block(use_grouped_mm=True)
    x = tokens()
    grouped_mm_runs(x.device, x.dtype)  # tried once, before counting
    with count_host_reads(lambda f: f.endswith(os.path.join("common", "moe", "layer.py"))) as reads:
        moe(x).sum().backward()
        expert_load(moe.tokens_per_expert)
    assert reads.calls == []
    loop = same_weights(moe, use_grouped_mm=False)
    with count_host_reads(lambda f: f.endswith(os.path.join("common", "moe", "layer.py"))) as reads:
        loop(x)
    assert [call[0] for call in reads.calls] == ["tolist"]  # the loop splits the rows on the host


@pytest.mark.skipif(not grouped_mm_runs(torch.device("cpu"), torch.float32), reason=GROUPED_REASON)
def test_a_first_forward_without_gradients_still_finds_the_grouped_path(monkeypatch):
    monkeypatch.setattr(moe_module, "_GROUPED_MM_RUNS", {})  # not tried yet
    moe = our_block()
    with torch.inference_mode():
        moe(tokens())
    assert moe.experts.grouped(tokens())


def test_a_first_forward_under_activation_checkpointing_recomputes_what_it_ran(monkeypatch):
    """The probe for torch._grouped_mm must not run inside the checkpointed forward only (the recomputation,
    the probe's answer cached, would save fewer tensors and checkpointing would refuse the backward)."""
    monkeypatch.setattr(moe_module, "_GROUPED_MM_RUNS", {})  # not tried yet
    moe = our_block()
    x = tokens().requires_grad_()
    checkpoint(moe, x, use_reentrant=False).sum().backward()
    assert x.grad is not None and moe.experts.grouped(tokens())


def test_the_block_runs_on_the_meta_device_with_gradients():
    """The planner measures a training forward and backward on the meta device (no autocast there)."""
    with torch.device("meta"):
        moe = our_block()
        x = torch.randn(2, 5, DIM, requires_grad=True)
    moe(x).sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


def test_widths_grouped_mm_cannot_take_fall_back_to_the_loop():
    """torch._grouped_mm needs 16-byte-aligned strides: a hidden width of 6 float32 (24 bytes) is not."""
    args = MoEArgs(4, 2, 6)
    moe = MoE(DIM, args)
    assert not moe.experts.grouped(tokens())
    moe.reset_parameters()
    assert moe(tokens()).shape == (3, 7, DIM)


def test_gradients_reach_the_router_and_every_expert():
    moe = our_block(aux_loss_coef=0.0)
    x = tokens(4, 16)  # 64 tokens x 2 choices: every one of 8 experts is chosen
    moe(x).square().mean().backward()
    assert (moe.tokens_per_expert > 0).all()
    for name, p in moe.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        per_expert = p.grad.flatten(1).abs().sum(1) if name.startswith("experts.") else p.grad.abs().sum()[None]
        assert (per_expert > 0).all(), name


def test_tokens_per_expert_counts_the_last_forward():
    moe = our_block()
    x = tokens(2, 5)
    with torch.no_grad():
        moe(x)
        indices = moe.router(x.view(-1, DIM)).indices
    assert torch.equal(moe.tokens_per_expert, torch.bincount(indices.flatten(), minlength=EXPERTS))
    assert moe.tokens_per_expert.sum() == 2 * 5 * TOP_K
    counts = moe.tokens_per_expert.float()
    assert expert_load(moe.tokens_per_expert) == counts.max() / counts.mean()
    moe.to(torch.bfloat16)
    assert moe.tokens_per_expert.dtype == torch.int64  # counts stay exact whatever the model's dtype


def biased_block() -> MoE:
    """A sigmoid router whose gate sends most tokens to expert 0: every token's input leans one way."""
    args = MoEArgs(4, 1, 8, score_func="sigmoid", balance="bias")
    torch.manual_seed(0)
    moe = MoE(DIM, args)
    moe.reset_parameters()
    with torch.no_grad():
        moe.router.gate.weight[0] = 0.5
    return moe


def test_the_bias_update_moves_toward_balance_and_changes_routing_not_weights():
    moe = biased_block()
    x = tokens(4, 16) + 1.0
    with torch.no_grad():
        before = moe.router(x.view(-1, DIM))
        moe(x)
    load_before = expert_load(moe.tokens_per_expert)
    counts = moe.tokens_per_expert.clone()
    update_balance_bias(moe, counts, rate=0.01)
    assert torch.equal(moe.router.expert_bias, 0.01 * torch.sign(counts.float().mean() - counts))
    for _ in range(200):
        with torch.no_grad():
            moe(x)
        update_balance_bias(moe, moe.tokens_per_expert, rate=0.01)
    with torch.no_grad():
        after = moe.router(x.view(-1, DIM))
        moe(x)
    # Every token on expert 0 at first (max / mean = 4); a fixed-size sign step then hovers near balance.
    assert load_before == 4 and expert_load(moe.tokens_per_expert) < 2, moe.tokens_per_expert
    assert moe.router.expert_bias[0] < 0 and (moe.router.expert_bias[1:] > 0).all()
    assert not torch.equal(after.indices, before.indices)
    torch.testing.assert_close(after.scores, before.scores, rtol=0, atol=0)  # the bias is not in the scores
    torch.testing.assert_close(after.weights, after.scores.gather(-1, after.indices), rtol=0, atol=0)


def test_the_bias_update_needs_a_bias_block():
    with pytest.raises(ValueError, match="balance='bias'"):
        update_balance_bias(our_block(), torch.ones(EXPERTS), 0.01)
    assert "router.expert_bias" in MoE(DIM, MoEArgs(4, 1, 8, balance="bias")).state_dict()  # checkpointed
    assert "router.expert_bias" not in MoE(DIM, MoEArgs(4, 1, 8)).state_dict()


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(top_k=9), "top_k"),
        (dict(top_k=0), "top_k"),
        (dict(n_experts=0, top_k=0), "n_experts"),
        (dict(score_func="relu"), "score_func"),
        (dict(balance="loss"), "balance"),
        (dict(aux_loss_style="gshard"), "aux_loss_style"),
        (dict(route_scale=0.0), "route_scale"),
        (dict(aux_loss_coef=-0.1), "aux_loss_coef"),
        (dict(shared_gate=True), "shared_gate"),
        (dict(dense_layers=(-1,)), "dense_layers"),
    ],
)
def test_arguments_that_cannot_work_are_refused_naming_the_field(changes, field):
    with pytest.raises(ValueError) as refused:
        MoEArgs(**{**dict(n_experts=EXPERTS, top_k=TOP_K, expert_dim=HIDDEN), **changes})
    message = str(refused.value)
    assert f"MoEArgs.{field}=" in message and "\n" not in message


@needs_transformers
def test_dense_layers_follow_qwen3_moe_s_mlp_only_layers_and_sparse_step():
    config = Qwen3MoeConfig(
        hidden_size=DIM,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        moe_intermediate_size=HIDDEN,
        intermediate_size=HIDDEN,
        num_experts=4,
        num_hidden_layers=7,
        mlp_only_layers=[3],
        decoder_sparse_step=2,
    )
    args = MoEArgs(4, 2, HIDDEN, dense_layers=dense_layers_from_hf(7, [3], 2))
    sparse = [
        isinstance(modeling_qwen3_moe.Qwen3MoeDecoderLayer(config, i).mlp, modeling_qwen3_moe.Qwen3MoeSparseMoeBlock)
        for i in range(7)
    ]
    assert [args.is_sparse(i) for i in range(7)] == sparse == [False, True, False, False, False, True, False]


def test_the_arguments_import_no_torch():
    code = "import sys, titanlite.models.common.moe.args; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


def _fsdp_moe_step(rank: int) -> None:
    """On each of 2 ranks: the MoE decoder under titanlite's FSDP, one training forward (pooled balance term on)
    and backward, recording every warning."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh

    from titanlite.builder.model import plain_model
    from titanlite.builder.plan import plan_model
    from titanlite.config import parse_config
    from titanlite.parallel.data_parallel import apply_fsdp
    from titanlite.parallel.parallelize import materialize

    cfg = parse_config(["--model.name", "qwen3_moe", "--model.flavor", "debug", "--model.tokenizer", "byte"])
    with torch.device("meta"):
        model = plain_model(cfg, plan_model(cfg))
    mesh = init_device_mesh("cpu", (2,))
    apply_fsdp(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, reshard_after_forward=True)
    materialize(model, torch.device("cpu"), seed=0)
    terms = AuxiliaryLosses(("load_balance", "router_z"))
    terms.begin_forward(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with collecting(terms):
            out = model(torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank)))
        out.float().square().mean().backward()
    assert "load_balance" in terms.current  # the pooled term joined the loss
    views = [str(w.message)[:120] for w in caught if "view tensor" in str(w.message)]
    assert not views, views


def test_the_moe_decoder_under_fsdp_returns_no_view_for_fsdp_to_warn_about():
    # FSDP2 warns when a wrapped module returns a view (an in-place op on it would skip the pre-backward hook);
    # the pooled balance term's join is an identity, a view, so it is joined before the final norm.
    from tests.helpers import run_ranks

    run_ranks(_fsdp_moe_step, nprocs=2)
