"""MiniMax-M2's arguments, torch-free: the shared MoE decoder's (MoEDecoderArgs; partial rotary by its rotary_dim),
and its sizes (the published MiniMax-M2, 230B total and about 10B active, beside a tiny debug model)."""

from __future__ import annotations

from dataclasses import dataclass, field

from titanlite.models.common.decoder_args import MoEDecoderArgs
from titanlite.models.common.moe.args import MoEArgs, bias_routed
from titanlite.models.spec import not_math


def routing(n_experts: int, top_k: int, expert_dim: int) -> MoEArgs:
    """MiniMax-M2's block: every layer's, experts scored by a sigmoid each, chosen by score plus the routing bias
    (e_score_correction_bias), their weights the chosen scores renormalised (bias_routed's, DeepSeek-V3's); no
    shared expert, no groups, no scaling."""
    return bias_routed(n_experts, top_k, expert_dim, route_scale=1.0, n_shared_experts=0, dense_layers=())


@dataclass
class MiniMaxM2Args(MoEDecoderArgs):
    """MiniMax-M2 (MiniMaxM2ForCausalLM): the shared MoE decoder with an RMSNorm over each token's whole query and
    key projection (qk_norm "full"), rotations of the leading `rotary_dim` channels of each head (the shared field;
    config.json's rotary_dim, or head_dim x partial_rotary_factor), and on every layer a mixture of sigmoid-routed
    experts with a routing bias (`routing`)."""

    family: str = not_math("minimax_m2")
    qk_norm: str = "full"
    moe: MoEArgs = field(default_factory=lambda: routing(8, 2, 32))


# vocab_size 0: the tokenizer's, padded to a multiple of 64.
FLAVORS = {
    # dim 64, 4 layers, 4 heads (2 for keys and values) of 16, 8 channels of each rotated; 8 experts of width 32,
    # 2 per token, on every layer.
    "debug": MiniMaxM2Args(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=32,
        vocab_size=0,
        head_dim=16,
        rotary_dim=8,
        rope_theta=5e6,
        norm_eps=1e-6,
    ),
    # MiniMaxAI/MiniMax-M2: 62 layers, 48 query and 8 key/value heads of 128 (64 channels rotated), 256 experts of
    # width 1536, 8 per token; untied, 200,064 ids, 196,608 positions.
    "minimax_m2": MiniMaxM2Args(
        dim=3072,
        n_layers=62,
        n_heads=48,
        n_kv_heads=8,
        ffn_dim=1536,
        vocab_size=200064,
        max_seq_len=196608,
        head_dim=128,
        rotary_dim=64,
        rope_theta=5e6,
        norm_eps=1e-6,
        moe=routing(256, 8, 1536),
    ),
}
