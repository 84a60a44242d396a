"""gpt-oss's arguments, torch-free: the MoE decoder's (titanlite/models/moe_decoder/args.py) and the experts' clamped
SwiGLU; its sizes (a tiny debug model, gpt-oss-20b and gpt-oss-120b)."""

from __future__ import annotations

from dataclasses import dataclass

from titanlite.models.common.decoder_args import MoEDecoderArgs
from titanlite.models.common.moe.args import MoEArgs
from titanlite.models.common.rope_args import YarnRopeScaling


@dataclass
class GptOssArgs(MoEDecoderArgs):
    """The MoE decoder with gpt-oss's switches always on: attention sinks (a learned logit per query head in each
    softmax), q/k/v/o biases, a router with a bias, experts with biases and the clamped SwiGLU
    (up.clamp(+-swiglu_limit) + 1) * g * sigmoid(swiglu_alpha * g), g = gate.clamp(max=swiglu_limit)."""

    swiglu_alpha: float = 1.702
    """Sigmoid gain of the experts' clamped SwiGLU (config.json swiglu_alpha)."""
    swiglu_limit: float = 7.0
    """Clamp of the experts' gate (above) and up projection (both sides) (config.json swiglu_limit)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.swiglu_limit <= 0:
            raise ValueError(f"GptOssArgs.swiglu_limit={self.swiglu_limit}; it must be positive")


def alternating(n_layers: int) -> tuple[str, ...]:
    """gpt-oss's layer types: sliding, full, sliding, full, ... (transformers' default for a config without them)."""
    return tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers))


# gpt-oss's rotary scaling: YaRN stretching 4,096 positions 32 times, the band's bounds not rounded.
YARN = YarnRopeScaling(
    factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, truncate=False
)


def gpt_oss(
    n_layers: int, n_experts: int, dim: int = 2880, vocab_size: int = 201088, aux_loss_coef: float = 0.9
) -> GptOssArgs:
    """A gpt-oss shape: 64 query heads of 64 (8 key/value heads), 4 experts of `dim` per token, window 128 on every
    other layer, 131,072 positions (RoPE theta 150,000 with YaRN), untied."""
    return GptOssArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=64,
        n_kv_heads=8,
        head_dim=64,
        ffn_dim=dim,
        vocab_size=vocab_size,
        max_seq_len=131072,
        rope_theta=150000.0,
        rope_scaling=YARN,
        norm_eps=1e-5,
        qkv_bias=True,
        out_bias=True,
        sliding_window=128,
        layer_types=alternating(n_layers),
        family="gpt_oss",
        moe=MoEArgs(
            n_experts=n_experts,
            top_k=4,
            expert_dim=dim,
            norm_topk_prob=True,
            router_bias=True,
            aux_loss_coef=aux_loss_coef,
        ),
    )


def debug() -> GptOssArgs:
    """4 layers (sliding, full, sliding, full; window 8), dim 64, 4 heads of 16 (2 key/value heads), 8 experts of
    width 32, 2 per token; YaRN from an original context of 32 (short sequences run past it)."""
    return GptOssArgs(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        ffn_dim=32,
        vocab_size=0,
        max_seq_len=2048,
        rope_theta=150000.0,
        rope_scaling=YarnRopeScaling(factor=4.0, original_max_position_embeddings=32, truncate=False),
        norm_eps=1e-5,
        qkv_bias=True,
        out_bias=True,
        sliding_window=8,
        layer_types=alternating(4),
        family="gpt_oss",
        moe=MoEArgs(n_experts=8, top_k=2, expert_dim=32, norm_topk_prob=True, router_bias=True),
    )


FLAVORS = {
    "debug": debug(),
    # openai/gpt-oss-20b: 24 layers, 32 experts (4 per token) of width 2880, 201,088 ids.
    "gpt_oss_20b": gpt_oss(24, 32),
    # openai/gpt-oss-120b: 36 layers, 128 experts.
    "gpt_oss_120b": gpt_oss(36, 128),
}


def with_depth(args: GptOssArgs, n_layers: int) -> dict:
    """model.n_layers: the depth, the layer types alternating as before."""
    return {"n_layers": n_layers, "layer_types": alternating(n_layers) if args.layer_types else ()}
