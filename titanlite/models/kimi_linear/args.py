"""Kimi Linear's arguments, torch-free: which layers are Kimi Delta Attention and which latent attention (without
rotary positions), each kind's widths, the mixture-of-experts block (titanlite/models/common/moe/args.py) and the
dense layers before it; the published size."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from titanlite.models.common.latent.args import LatentArgs
from titanlite.models.common.linear_attention_args import LAYER_KINDS, hybrid_layers
from titanlite.models.common.moe.args import MoEArgs, bias_routed, debug_bias_routed
from titanlite.models.spec import not_math


@dataclass
class KimiLinearArgs(LatentArgs):
    """Kimi Linear (titanlite/models/kimi_linear/model.py): pre-norm blocks whose mixer is, per `layer_types`, Kimi
    Delta Attention ("linear_attention": titanlite/models/common/kimi_delta.py) or multi-head latent attention with no
    rotary positions ("full_attention"; its ranks and widths: LatentArgs, titanlite/models/common/latent/args.py),
    and whose feed-forward is, except at moe.dense_layers, a mixture of experts."""

    latent_rotary: ClassVar[bool] = False  # the qk_rope_head_dim channels are kept, not rotated

    dim: int
    n_layers: int
    n_heads: int
    """Latent attention's heads (num_attention_heads)."""
    ffn_dim: int
    """Width of the dense layers' SwiGLU (intermediate_size)."""
    layer_types: tuple[str, ...]
    """Per layer "linear_attention" (KDA) or "full_attention" (latent attention)."""
    vocab_size: int = not_math()
    max_seq_len: int = not_math(4096)
    norm_eps: float = 1e-5
    """The blocks' RMSNorms' and KDA's output norm's epsilon (rms_norm_eps; the latent norms use 1e-6)."""
    tie_embeddings: bool = False
    linear_heads: int = 32
    """KDA's heads (linear_attn_config.num_heads): queries, keys and values alike."""
    linear_head_dim: int = 128
    """KDA's head width (linear_attn_config.head_dim), also the rank of its forget and output gates."""
    conv_size: int = 4
    """KDA's short convolution's width in tokens (linear_attn_config.short_conv_kernel_size)."""
    family: str = not_math("kimi_linear")
    # 8 experts, 2 per token, one shared expert; the first layer dense.
    moe: MoEArgs = field(default_factory=lambda: debug_bias_routed(2.446))

    def __post_init__(self) -> None:
        super().__post_init__()
        self.layer_types = tuple(self.layer_types)
        if len(self.layer_types) != self.n_layers:
            raise ValueError(
                f"KimiLinearArgs.layer_types has {len(self.layer_types)} entries for n_layers={self.n_layers}"
            )
        unknown = sorted(set(self.layer_types) - set(LAYER_KINDS))
        if unknown:
            raise ValueError(f"KimiLinearArgs.layer_types has {unknown[0]!r}; use {' or '.join(LAYER_KINDS)}")
        for name in ("linear_heads", "linear_head_dim", "conv_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"KimiLinearArgs.{name}={getattr(self, name)}; it must be at least 1")
        self.moe.check_depth(self.n_layers)

    def attention_layers(self) -> tuple[int, ...]:
        """The latent-attention layers."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == "full_attention")


def with_depth(args: KimiLinearArgs, n_layers: int) -> dict:
    """model.n_layers: the depth, the layer kinds cut or continued every fourth, the dense layers that still exist."""
    kinds = args.layer_types[:n_layers] + hybrid_layers(n_layers)[len(args.layer_types) :]
    return {"n_layers": n_layers, "layer_types": kinds, "moe": args.moe.at_depth(n_layers)}


def split_sizes(args: KimiLinearArgs) -> dict[str, int]:
    """The sizes a tensor-parallel degree must divide: both mixers' heads (each rank holds whole heads), the dense
    width, the vocabulary (the low-rank and latent projections are not split)."""
    return {
        "n_heads": args.n_heads,
        "linear_heads": args.linear_heads,
        "ffn_dim": args.ffn_dim,
        "vocab_size": args.vocab_size,
    }


def _kimi_linear_48b_a3b() -> KimiLinearArgs:
    """moonshotai/Kimi-Linear-48B-A3B (Base and Instruct): 27 layers of width 2304, latent attention at layers
    4, 8, ..., 24 and 27 (config.json's 1-based full_attn_layers), KDA with 32 heads of 128 elsewhere; 256 experts
    of 1024, 8 per token by sigmoid scores with the correction bias, one shared; the first layer dense."""
    return KimiLinearArgs(
        dim=2304,
        n_layers=27,
        n_heads=32,
        ffn_dim=9216,
        layer_types=hybrid_layers(27, last_full=True),
        vocab_size=163840,
        max_seq_len=1048576,
        norm_eps=1e-5,
        q_lora_rank=0,  # its latent widths: LatentArgs' defaults (DeepSeek's)
        linear_heads=32,
        linear_head_dim=128,
        conv_size=4,
        moe=bias_routed(256, 8, 1024, 2.446),
    )


# vocab_size 0: the tokenizer's, padded to a multiple of 64.
FLAVORS = {
    # dim 64, 4 layers (KDA, KDA, KDA, latent attention; the first dense), KDA 4 heads of 16, latent attention
    # 4 heads of key 16 + 8, value 16, latent 32.
    "debug": KimiLinearArgs(
        dim=64,
        n_layers=4,
        n_heads=4,
        ffn_dim=128,
        layer_types=hybrid_layers(4),
        vocab_size=0,
        max_seq_len=2048,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        linear_heads=4,
        linear_head_dim=16,
    ),
    "kimi_linear_48b_a3b": _kimi_linear_48b_a3b(),
}
