"""Training FLOPs per token of a decoder: the formula every dense family's spec names (`ModelSpec.flops`), attention's
sequence term counted over the attention layers and, in place of it, what each other sequence mixer reports as its own
(`SequenceMixer`: the hybrid families' linear attention). A family whose matmuls differ (a mixture of experts: only
the routed experts' parameters work per token) names its own function of (model, seq_len) instead. Also the
parameters one token uses (active_parameters), which the start-up log and `titanlite plan` show beside the total for a
mixture of experts."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import nn

from titanlite.models.common.interface import DecoderModule
from titanlite.models.common.moe.layer import GroupedExperts, MoE


@runtime_checkable
class SequenceMixer(Protocol):
    """A mixer whose sequence work is not attention's 12 * d * T (a linear-attention layer: GatedDeltaNet,
    KimiDeltaAttention): it says its own training FLOPs per token, beyond its parameters' matmuls."""

    def sequence_flops_per_token(self, seq_len: int) -> float: ...


def dense_flops_per_token(model: DecoderModule, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), the formula of PaLM (Chowdhery et al., 2022, app. B):

        6 * N  +  12 * L * d * T  (+ R per linear-attention layer)

    N counts the parameters that do a matmul per token: every parameter except the embedding tables
    (token and position lookups cost no FLOPs), plus the output projection (counted even when its
    weight is tied to the token embedding, since the matmul happens). The second term is attention's
    QK^T and AV matmuls (2 matmuls x 2 FLOPs x d x T per layer, x3 for backward), with L the layers that
    attend over the sequence, attention width d (heads x head_dim: the model width unless a Hugging Face shape
    says otherwise) and sequence length T; causal masking is not discounted, as in PaLM and TorchTitan. A
    linear-attention layer (the hybrid families) has no T term: its sequence work is what it reports (a
    SequenceMixer; the gated delta rule's R per token, DeltaRule.flops_per_token), and its projections and
    convolution are parameters in N.

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
    """The work per token that mixes the sequence, beyond the parameters' matmuls: what each SequenceMixer among the
    model's modules reports for its layer, and attention's 12 * d * T in each block whose mixer (`attention`) is
    attention: not a SequenceMixer, and present (a block of a feed-forward alone, Nemotron-H's MLP and MoE layers,
    mixes no tokens; a block of two mixers side by side, Falcon-H1's, counts its attention and reports its Mamba)."""
    args = model.args
    reported = sum(m.sequence_flops_per_token(seq_len) for m in model.modules() if isinstance(m, SequenceMixer))
    attending = sum(
        1
        for block in model.layers.values()
        if (mixer := getattr(block, "attention", None)) is not None and not isinstance(mixer, SequenceMixer)
    )
    return 12.0 * attending * args.n_heads * args.head_dim * seq_len + reported


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
