"""DeepSeek-V4's routing and experts in the shared MoE block (titanlite/models/common/moe/layer.py): sqrt(softplus)
scores, the SwiGLU clamped at swiglu_limit (routed and shared experts) and the hash layers' token-id table compute what
transformers' DeepseekV4SparseMoeBlock computes from the same weights, on the grouped-GEMM path and the loop; the
arguments and the table check refuse what cannot work with a one-line reason."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from titanlite.models.common.moe.args import MoEArgs
from titanlite.models.common.moe.balance import PooledBalance, PooledMoE
from titanlite.models.common.moe.layer import (
    HashRouter,
    LimitedSwiGLU,
    MoE,
    check_hash_table,
    grouped_mm_runs,
    load_balancing_loss,
)

try:
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4 import modeling_deepseek_v4
except ImportError:  # the block's own tests still run
    modeling_deepseek_v4 = None
needs_transformers = pytest.mark.skipif(
    modeling_deepseek_v4 is None, reason="transformers is an optional test dependency (pip install .[hf])"
)

DIM, HIDDEN, EXPERTS, TOP_K, VOCAB, SCALE = 16, 8, 4, 2, 32, 1.5
LIMIT = 0.05  # small against pre-activations of std ~2 (weights of std 0.5): the clamp bites
HASH_LAYER, TOPK_LAYER = 0, 1
GROUPED = [
    False,
    pytest.param(
        True,
        marks=pytest.mark.skipif(
            not grouped_mm_runs(torch.device("cpu"), torch.float32),
            reason="torch._grouped_mm does not run for float32 on this device and torch",
        ),
    ),
]


def v4_args(limit: float = LIMIT, **changes) -> MoEArgs:
    """Our arguments for the tiny DeepSeek-V4 block: layer 0 hashed, layer 1 top-k with the balancing bias."""
    args = MoEArgs(
        EXPERTS,
        TOP_K,
        HIDDEN,
        score_func="sqrtsoftplus",
        norm_topk_prob=True,
        route_scale=SCALE,
        n_shared_experts=1,
        balance="bias",
        swiglu_limit=limit,
        hash_layers=(HASH_LAYER,),
    )
    return dataclasses.replace(args, **changes)


def hf_block(layer: int, limit: float = LIMIT):
    """transformers' DeepSeek-V4 MoE block of `layer` ("hash_moe" at 0, "moe" at 1) with random weights, a random
    balancing bias and a random token-id table whose rows name distinct experts."""
    config = DeepseekV4Config(
        hidden_size=DIM,
        moe_intermediate_size=HIDDEN,
        n_routed_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        n_shared_experts=1,
        vocab_size=VOCAB,
        num_hidden_layers=2,
        mlp_layer_types=["hash_moe", "moe"],
        scoring_func="sqrtsoftplus",
        swiglu_limit=limit,
        routed_scaling_factor=SCALE,
    )
    config._experts_implementation = "eager"
    block = modeling_deepseek_v4.DeepseekV4SparseMoeBlock(config, layer)
    generator = torch.Generator().manual_seed(layer)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
        if block.is_hash:
            rows = [torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(VOCAB)]
            block.gate.tid2eid.copy_(torch.stack(rows))
        else:
            block.gate.e_score_correction_bias.copy_(torch.randn(EXPERTS, generator=generator) * 0.3)
    return block


def ours_from(block, args: MoEArgs, use_grouped_mm: bool | None = None) -> MoE:
    """Our block holding `block`'s weights (hashed where it is)."""
    moe = MoE(DIM, args, use_grouped_mm=use_grouped_mm, hash_vocab=VOCAB if block.is_hash else 0)
    w1, w3 = block.experts.gate_up_proj.detach().chunk(2, dim=1)
    with torch.no_grad():
        moe.router.gate.weight.copy_(block.gate.weight)
        if block.is_hash:
            moe.router.tid2eid.copy_(block.gate.tid2eid)
        else:
            assert moe.router.expert_bias is not None
            moe.router.expert_bias.copy_(block.gate.e_score_correction_bias)
        moe.experts.w1.copy_(w1)
        assert moe.experts.w3 is not None and moe.shared_expert is not None
        moe.experts.w3.copy_(w3)
        moe.experts.w2.copy_(block.experts.down_proj)
        shared = moe.shared_expert
        assert shared.w3 is not None
        shared.w1.weight.copy_(block.shared_experts.gate_proj.weight)
        shared.w3.weight.copy_(block.shared_experts.up_proj.weight)
        shared.w2.weight.copy_(block.shared_experts.down_proj.weight)
    return moe


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return torch.randn(2, 5, DIM, generator=generator), torch.randint(0, VOCAB, (2, 5), generator=generator)


@needs_transformers
@pytest.mark.parametrize("limit", [LIMIT, 10.0])
@pytest.mark.parametrize("grouped", GROUPED)
@pytest.mark.parametrize("layer", [TOPK_LAYER, HASH_LAYER])
def test_block_matches_transformers_deepseek_v4(layer: int, grouped: bool, limit: float):
    block = hf_block(layer, limit)
    moe = ours_from(block, v4_args(limit), use_grouped_mm=grouped)
    x, tokens = inputs()
    with torch.no_grad():
        theirs = block(x, tokens) if block.is_hash else block(x)
        ours = moe(x, tokens)
    assert isinstance(moe.router, HashRouter) == (layer == HASH_LAYER)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)


@needs_transformers
@pytest.mark.parametrize("layer", [TOPK_LAYER, HASH_LAYER])
def test_swiglu_limit_clamps_routed_and_shared_experts(layer: int):
    block = hf_block(layer)
    clamped, unclamped = ours_from(block, v4_args()), ours_from(block, v4_args(limit=0.0))
    assert isinstance(clamped.experts.activation, LimitedSwiGLU)
    assert clamped.shared_expert is not None and clamped.shared_expert.activation == LimitedSwiGLU(LIMIT)
    x, tokens = inputs()
    with torch.no_grad():
        assert not torch.allclose(clamped(x, tokens), unclamped(x, tokens), atol=1e-3)
        assert clamped.shared_expert is not None and unclamped.shared_expert is not None
        assert not torch.allclose(clamped.shared_expert(x), unclamped.shared_expert(x), atol=1e-3)


def test_limited_swiglu_clamps_gate_above_and_up_both_ways():
    gate, up = torch.tensor([-3.0, 0.5, 4.0]), torch.tensor([-2.0, 0.1, 3.0])
    expected = torch.nn.functional.silu(torch.tensor([-3.0, 0.5, 1.0])) * torch.tensor([-1.0, 0.1, 1.0])
    torch.testing.assert_close(LimitedSwiGLU(1.0)(gate, up), expected)


@needs_transformers
def test_hash_layer_trains_its_gate_and_experts():
    moe = ours_from(hf_block(HASH_LAYER), v4_args(limit=10.0))
    x, tokens = inputs()
    moe(x, tokens).square().sum().backward()
    for name, p in moe.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_hash_router_takes_the_table_row_of_each_token():
    moe = MoE(DIM, v4_args(), hash_vocab=VOCAB)
    router = moe.router
    assert isinstance(router, HashRouter) and router.expert_bias is None  # the table chooses: no balancing bias
    table = torch.tensor([[(t + 1) % EXPERTS, t % EXPERTS] for t in range(VOCAB)])
    router.tid2eid.copy_(table)
    x, tokens = inputs()
    route = router(x.reshape(-1, DIM), tokens.reshape(-1))
    assert torch.equal(route.indices, table[tokens.reshape(-1)])
    scores = torch.nn.functional.softplus(router.gate(x.reshape(-1, DIM))).sqrt()
    chosen = scores.gather(-1, route.indices)
    torch.testing.assert_close(route.weights, chosen / chosen.sum(-1, keepdim=True) * SCALE)
    names = set(moe.state_dict())
    assert {"router.gate.weight", "router.tid2eid"} <= names and "router.expert_bias" not in names
    moe.reset_parameters()  # the gate refilled, the table kept
    assert torch.equal(router.tid2eid, table)


def test_pooled_block_builds_a_hash_router():
    assert isinstance(PooledMoE(DIM, v4_args(), PooledBalance(), hash_vocab=VOCAB).router, HashRouter)


def test_balancing_loss_normalises_sqrtsoftplus_scores_per_token():
    generator = torch.Generator().manual_seed(3)
    scores = torch.nn.functional.softplus(torch.randn(6, EXPERTS, generator=generator)).sqrt()
    indices = scores.topk(TOP_K, dim=-1).indices
    counts = torch.zeros(EXPERTS, dtype=torch.int64).scatter_add_(0, indices.reshape(-1), torch.ones(12).long())
    as_probs = load_balancing_loss(
        scores / scores.sum(-1, keepdim=True), indices, counts, v4_args(score_func="softmax")
    )
    torch.testing.assert_close(load_balancing_loss(scores, indices, counts, v4_args()), as_probs)


def test_hash_block_refuses_forward_without_tokens():
    moe = MoE(DIM, v4_args(), hash_vocab=VOCAB)
    x, tokens = inputs()
    with pytest.raises(ValueError, match="needs forward\\(x, tokens\\)"):
        moe(x)
    with pytest.raises(ValueError, match="token ids"):
        moe(x, tokens[:, :3])
    MoE(DIM, v4_args())(x)  # a top-k block needs none


def test_hash_layers_are_checked_like_dense_layers():
    args = v4_args(hash_layers=(0, 2), dense_layers=(1,))
    assert args.is_hashed(2) and not args.is_hashed(1) and args.is_sparse(2)
    assert args.at_depth(2).hash_layers == (0,)
    with pytest.raises(ValueError, match="hash_layers=\\[0, 2\\] names layers beyond n_layers=2"):
        args.check_depth(2)
    with pytest.raises(ValueError, match="hash_layers.*names dense layers \\[1\\]"):
        v4_args(hash_layers=(0, 1), dense_layers=(1,))
    with pytest.raises(ValueError, match="hash_layers"):
        v4_args(hash_layers=(-1,))


def test_swiglu_limit_refusals():
    with pytest.raises(ValueError, match="swiglu_limit=-1.0; it must not be negative"):
        v4_args(limit=-1.0)
    with pytest.raises(ValueError, match="swiglu_limit=0.05 clamps a SwiGLU; activation='relu2'"):
        v4_args(activation="relu2", n_shared_experts=0)


def test_check_hash_table_names_the_problem():
    good = torch.stack([torch.randperm(EXPERTS)[:TOP_K] for _ in range(VOCAB)])
    assert check_hash_table(good, EXPERTS, TOP_K) is None
    too_big = good.clone()
    too_big[5, 1] = EXPERTS
    reason = check_hash_table(too_big, EXPERTS, TOP_K)
    assert reason is not None and f"expert index {EXPERTS}" in reason and f"n_experts={EXPERTS}" in reason
    negative = good.clone()
    negative[0, 0] = -1
    assert "expert index -1" in (check_hash_table(negative, EXPERTS, TOP_K) or "")
    assert "shape [32, 3]" in (check_hash_table(torch.zeros(VOCAB, 3, dtype=torch.int64), EXPERTS, TOP_K) or "")
    assert "float32" in (check_hash_table(good.float(), EXPERTS, TOP_K) or "")
