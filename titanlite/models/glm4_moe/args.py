"""GLM-4.5's arguments, torch-free: the shared MoE decoder's (MoEDecoderArgs; partial rotary by its rotary_dim), and
the published sizes (GLM-4.5, GLM-4.5-Air, GLM-4.6) beside a tiny debug model."""

from __future__ import annotations

from dataclasses import dataclass, field

from titanlite.models.common.decoder_args import DEBUG_SIZES, MoEDecoderArgs
from titanlite.models.common.moe.args import MoEArgs, bias_routed, debug_bias_routed
from titanlite.models.spec import not_math


@dataclass
class Glm4MoeArgs(MoEDecoderArgs):
    """GLM-4.5 (Glm4MoeForCausalLM): the shared MoE decoder with biases on the query, key and value projections
    (attention_bias; none on the output), optional per-head Q/K norms (use_qk_norm), rotations of the leading
    `rotary_dim` channels of each head (the shared field; config.json's head_dim x partial_rotary_factor), and,
    after the first moe.dense_layers (first_k_dense_replace), mixtures of sigmoid-routed experts in groups with a
    routing bias and shared experts."""

    family: str = not_math("glm4_moe")
    # 8 experts of width 32 in 2 groups (1 kept per token), 2 per token, one shared expert; the first layer dense.
    moe: MoEArgs = field(default_factory=lambda: debug_bias_routed(2.5, n_groups=2, topk_groups=1))
    mtp_layers: int = 0
    """Multi-token prediction depths (num_nextn_predict_layers; models/common/multi_token.py), each a sparse block
    after the decoder's layers."""


def _glm(**shape) -> Glm4MoeArgs:
    """The shape every published GLM-4.5 shares: 96 query and 8 key/value heads of 128 (half of each rotated),
    QKV biases, rope_theta 1e6, 8 experts per token, renormalised, one shared expert, vocabulary 151,552."""
    common: dict = dict(
        n_heads=96,
        n_kv_heads=8,
        head_dim=128,
        rotary_dim=64,
        vocab_size=151552,
        max_seq_len=131072,
        rope_theta=1e6,
        norm_eps=1e-5,
        tie_embeddings=False,
        qkv_bias=True,
    )
    return Glm4MoeArgs(**(common | shape))


def _moe(n_experts: int, expert_dim: int, route_scale: float, dense: int) -> MoEArgs:
    return bias_routed(n_experts, 8, expert_dim, route_scale, dense_layers=tuple(range(dense)))


# vocab_size 0: the tokenizer's, padded to a multiple of 64.
FLAVORS = {
    # dim 64, 4 layers (the first dense, FFN 192), 4 heads (2 for keys and values) of 32, 16 channels rotated,
    # QKV biases, per-head Q/K norms.
    "debug": Glm4MoeArgs(
        **DEBUG_SIZES,
        head_dim=32,
        rotary_dim=16,
        qkv_bias=True,
        qk_norm="head",
    ),
    # zai-org/GLM-4.5 (355B-A32B): 92 layers, the first 3 dense, 160 experts of 1536, routed_scaling_factor 2.5,
    # per-head Q/K norms.
    "glm4_5": _glm(dim=5120, n_layers=92, ffn_dim=12288, qk_norm="head", moe=_moe(160, 1536, 2.5, 3)),  # fmt: skip
    # zai-org/GLM-4.5-Air (106B-A12B): 46 layers, the first dense, 128 experts of 1408, routed_scaling_factor 1.0,
    # no Q/K norms.
    "glm4_5_air": _glm(dim=4096, n_layers=46, ffn_dim=10944, moe=_moe(128, 1408, 1.0, 1)),
    # zai-org/GLM-4.6: GLM-4.5's shape with a 202,752-token context.
    "glm4_6": _glm(
        dim=5120, n_layers=92, ffn_dim=12288, qk_norm="head", max_seq_len=202752, moe=_moe(160, 1536, 2.5, 3)
    ),  # fmt: skip
}
