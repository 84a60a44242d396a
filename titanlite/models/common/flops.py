"""Training FLOPs per token of a decoder: the formula every dense family's spec names (`ModelSpec.flops`), attention's
sequence term counted over the full-attention layers and the gated delta rule's over the linear-attention ones (the
hybrid families). A family whose matmuls differ (a mixture of experts: only the routed experts' parameters work per
token) names its own function of (model, seq_len) instead. Also the parameters one token uses (active_parameters),
which the start-up log and `titanlite plan` show beside the total for a mixture of experts."""

from __future__ import annotations

from torch import nn

from titanlite.models.common.gated_delta_net import GatedDeltaNet
from titanlite.models.common.interface import DecoderModule
from titanlite.models.common.kimi_delta import KimiDeltaAttention
from titanlite.models.common.moe.layer import GroupedExperts, MoE


def dense_flops_per_token(model: DecoderModule, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), the formula of PaLM (Chowdhery et al., 2022, app. B):

        6 * N  +  12 * L * d * T  (+ R per linear-attention layer)

    N counts the parameters that do a matmul per token: every parameter except the embedding tables
    (token and position lookups cost no FLOPs), plus the output projection (counted even when its
    weight is tied to the token embedding, since the matmul happens). The second term is attention's
    QK^T and AV matmuls (2 matmuls x 2 FLOPs x d x T per layer, x3 for backward), with L the layers that
    attend over the sequence, attention width d (heads x head_dim: the model width unless a Hugging Face shape
    says otherwise) and sequence length T; causal masking is not discounted, as in PaLM and TorchTitan. A
    linear-attention layer (the hybrid families) has no T term: its sequence work is the gated delta rule's, R
    per token (delta_rule_flops_per_token), and its projections and convolution are parameters in N.

    Multi-token prediction's depths (models/common/multi_token.py) count as the layers they are: their blocks and
    projections in N, their attention in L, and each runs the output projection once more (vocab x dim in N again).
    """
    head = model.output.weight.numel() if model.output is not None else model.args.vocab_size * model.args.dim
    ahead = getattr(model, "mtp_layers", 0) * head
    return 6.0 * (matmul_parameters(model) + ahead) + sequence_flops_per_token(model, seq_len)


def matmul_parameters(model: DecoderModule) -> int:
    """N of the formula: every parameter but the embedding tables, plus a tied output projection."""
    embeddings = {id(m.weight) for m in (model.tok_embeddings, getattr(model, "pos_embeddings", None)) if m is not None}
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values() if id(p) not in embeddings)
    if model.output is not None and id(model.output.weight) in embeddings:
        n += model.output.weight.numel()
    return n


def sequence_flops_per_token(model: DecoderModule, seq_len: int) -> float:
    """The work per token that mixes the sequence, beyond the parameters' matmuls: attention's 12 * d * T in each
    layer that attends, the gated delta rule's R in each linear-attention layer (found among the model's modules)."""
    args = model.args
    rules = [m for m in model.modules() if isinstance(m, (GatedDeltaNet, KimiDeltaAttention))]
    attending = args.n_layers + getattr(model, "mtp_layers", 0) - len(rules)
    return 12.0 * attending * args.n_heads * args.head_dim * seq_len + sum(map(delta_rule_flops_per_token, rules))


def delta_rule_flops_per_token(layer: GatedDeltaNet | KimiDeltaAttention) -> float:
    """Training FLOPs per token of a linear-attention layer's gated delta rule, as its chunked kernel
    (linear_attention.gated_delta_rule_chunked, chunk size C) computes it, per value head with key width Dk and
    value width Dv, for each chunk of C tokens:

        two C x C score matrices, A (keys with keys) and Q K^T      2 x 2 C^2 Dk
        two triangular solves (I + A) X = ..., Dv and Dk columns    C^2 (Dv + Dk)
        the scores times the chunk's writes                         2 C^2 Dv
        the state read by the writes and by the queries, and
        written with the chunk's keys, a [Dk, Dv] state            3 x 2 C Dk Dv

    so per token R = 3 * H * (5 C Dk + 3 C Dv + 6 Dk Dv), x3 for backward as every matmul in the formula. One decay per
    key channel (Kimi Delta Attention) makes each score an einsum over a [C, C, Dk] decay: one multiply more per
    term, 7 C Dk in place of 5 C Dk. T's padding to a multiple of C and the exponentials of the decays are not
    counted, as norms are not. Linear in T (a fixed C), where attention's term grows with it."""
    chunk = layer.rule.chunk_size
    if isinstance(layer, GatedDeltaNet):
        heads, key_dim, value_dim, score_terms = (
            layer.wv.out_features // layer.value_dim,
            layer.key_dim,
            layer.value_dim,
            5,
        )
    else:
        heads, key_dim, value_dim, score_terms = (
            layer.wv.out_features // layer.head_dim,
            layer.head_dim,
            layer.head_dim,
            7,
        )
    forward = score_terms * chunk * key_dim + 3 * chunk * value_dim + 6 * key_dim * value_dim
    return 3.0 * heads * forward


def moe_flops_per_token(model: DecoderModule, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) of a mixture of experts, from its ACTIVE parameters:

        6 * N_active  +  12 * L * d * T

    dense_flops_per_token's formula with N_active in place of N: each MoE block's routed experts count
    top_k / n_experts of their parameters (a token runs through top_k of them), while the router's gate, any
    shared expert, attention, norms, dense layers and the output projection count whole. Dispatch (sorting,
    gathering, the weighted sum of the k outputs) is not counted, as norms and softmax are not. N_active is
    active_parameters less the embedding tables (lookups), plus a tied output projection (a matmul).
    """
    return dense_flops_per_token(model, seq_len) - 6.0 * idle_expert_parameters(model)


def idle_expert_parameters(model: nn.Module) -> int:
    """The routed experts' parameters one token does not use: n_experts - top_k experts of every MoE block."""
    idle = 0
    for module in model.modules():
        if isinstance(module, MoE):
            experts: GroupedExperts = module.experts
            per_expert = sum(p.numel() for p in experts.parameters()) // module.args.n_experts
            idle += (module.args.n_experts - module.args.top_k) * per_expert
    return idle


def active_parameters(model: nn.Module) -> int:
    """The parameters one token uses: all of them (embedding tables included, as model cards count them) but
    the idle routed experts of each MoE block (top_k of n_experts work per token). A dense model's total."""
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return total - idle_expert_parameters(model)
