"""DeepSeek-V3's arguments, torch-free: the shared latent attention's (titanlite/models/common/latent/args.py) with
the model's shape and YaRN, the mixture-of-experts block (titanlite/models/common/moe/args.py) and the dense layers
before it; the published sizes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from titanlite.models.common.latent.args import LatentArgs
from titanlite.models.common.moe.args import MoEArgs, bias_routed, debug_bias_routed
from titanlite.models.common.rope_args import YarnRopeScaling
from titanlite.models.spec import not_math


@dataclass
class DeepseekV3Args(LatentArgs):
    """DeepSeek-V3 (titanlite/models/deepseek_v3/model.py): pre-norm blocks of multi-head latent attention (its ranks
    and widths: LatentArgs, titanlite/models/common/latent/args.py) and, except at moe.dense_layers
    (first_k_dense_replace), a mixture of experts."""

    dim: int
    n_layers: int
    n_heads: int
    ffn_dim: int
    """Width of the dense layers' SwiGLU (intermediate_size)."""
    vocab_size: int = not_math()
    max_seq_len: int = not_math(4096)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    rope_scaling: YarnRopeScaling | None = None
    """YaRN (titanlite/models/common/rope_args.py); with mscale_all_dim, the softmax scale is multiplied by
    yarn_mscale(factor, mscale_all_dim)**2, as transformers does; None: plain RoPE."""
    rope_interleave: bool = not_math(True)
    """How a Hugging Face folder lays out each rotary head's rows: True, adjacent pairs (config.json's
    rope_interleave, DeepSeek's own layout); False, halves (rotate_half). The model always rotates adjacent
    pairs; the weights are reordered on import and export, so this changes no math."""
    family: str = not_math("deepseek_v3")
    # 8 experts in 4 groups, 2 groups kept per token; one shared expert; the first layer dense.
    moe: MoEArgs = field(default_factory=lambda: debug_bias_routed(2.5, n_groups=4, topk_groups=2))
    mtp_layers: int = 0
    """Multi-token prediction depths (num_nextn_predict_layers; models/common/multi_token.py), each a sparse
    block after the decoder's layers."""
    layer_types: ClassVar[tuple[str, ...]] = ()  # every layer latent attention

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mtp_layers < 0:
            raise ValueError(f"DeepseekV3Args.mtp_layers={self.mtp_layers}; use 0 (none) or more")
        self.moe.check_depth(self.n_layers)


def first_dense(k: int) -> tuple[int, ...]:
    """The dense layers of first_k_dense_replace = k: layers 0..k-1."""
    return tuple(range(k))


def split_sizes(args: DeepseekV3Args) -> dict[str, int]:
    """The sizes a tensor-parallel degree must divide: the heads (each rank holds whole heads), the dense width,
    the vocabulary (the latent projections are not split)."""
    return {"n_heads": args.n_heads, "ffn_dim": args.ffn_dim, "vocab_size": args.vocab_size}


def _yarn_40x(mscale: float) -> YarnRopeScaling:
    """DeepSeek's YaRN: 40 times the 4096 positions trained on, with `mscale` (and mscale_all_dim) as given."""
    return YarnRopeScaling(
        factor=40.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=mscale,
        mscale_all_dim=mscale,
    )


# The published flavors' latent widths are LatentArgs' defaults, DeepSeek's: latent 512, key 128 + 64 rotary, value 128.


def _deepseek_v3_671b() -> DeepseekV3Args:
    """deepseek-ai/DeepSeek-V3 (and V3-0324, R1): 61 layers, the first 3 dense, 256 routed experts in 8 groups
    (4 kept), 8 per token, one shared; YaRN 40x over 4096 positions."""
    return DeepseekV3Args(
        dim=7168,
        n_layers=61,
        n_heads=128,
        ffn_dim=18432,
        vocab_size=129280,
        max_seq_len=163840,
        q_lora_rank=1536,
        rope_scaling=_yarn_40x(1.0),
        moe=bias_routed(256, 8, 2048, 2.5, n_groups=8, topk_groups=4, dense_layers=first_dense(3)),
    )


def _deepseek_v2_lite() -> DeepseekV3Args:
    """deepseek-ai/DeepSeek-V2-Lite (15.7B, 2.4B active) in this architecture: no query compression, 64 experts by
    softmax, 6 per token, not renormalised, 2 shared; no correction bias (balance by the auxiliary loss),
    one group; the first layer dense; YaRN 40x with mscale 0.707 (DeepseekV2ForCausalLM's parameters)."""
    return DeepseekV3Args(
        dim=2048,
        n_layers=27,
        n_heads=16,
        ffn_dim=10944,
        vocab_size=102400,
        max_seq_len=163840,
        q_lora_rank=0,
        rope_scaling=_yarn_40x(0.707),
        moe=MoEArgs(
            n_experts=64,
            top_k=6,
            expert_dim=1408,
            score_func="softmax",
            norm_topk_prob=False,
            route_scale=1.0,
            n_shared_experts=2,
            balance="aux_loss",
            aux_loss_coef=0.001,
            dense_layers=first_dense(1),
        ),
    )


def _moonlight_16b_a3b() -> DeepseekV3Args:
    """moonshotai/Moonlight-16B-A3B (model_type deepseek_v3): V2-Lite's attention with V3's sigmoid routing and
    correction bias, 64 experts in one group, 6 per token, 2 shared; rope_theta 50000, 8192 positions."""
    return DeepseekV3Args(
        dim=2048,
        n_layers=27,
        n_heads=16,
        ffn_dim=11264,
        vocab_size=163840,
        max_seq_len=8192,
        rope_theta=50000.0,
        norm_eps=1e-5,
        q_lora_rank=0,
        moe=bias_routed(64, 6, 1408, 2.446, n_shared_experts=2, dense_layers=first_dense(1)),
    )


# vocab_size 0: the tokenizer's, padded to a multiple of 64.
FLAVORS = {
    # dim 64, 3 layers (the first dense), 4 heads of query rank 32, latent 32, key 16 + 8 rotary, value 16.
    "debug": DeepseekV3Args(
        dim=64,
        n_layers=3,
        n_heads=4,
        ffn_dim=128,
        vocab_size=0,
        max_seq_len=2048,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
    ),
    "deepseek_v3_671b": _deepseek_v3_671b(),
    "deepseek_v2_lite": _deepseek_v2_lite(),
    "moonlight_16b_a3b": _moonlight_16b_a3b(),
}
