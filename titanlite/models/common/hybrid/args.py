"""The hybrid decoder's arguments, torch-free: the shared decoder's (DecoderArgs) with two layer kinds, Gated DeltaNet
linear attention and gated full attention (Qwen3.5's decoder, which Qwen3.5-MoE and Qwen3-Next share), the linear
layers' shape and the full layers' partial rotary; the helpers that read them. A family's folder subclasses them with
its name and gives its sizes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

from titanlite.models.common.decoder_args import DEBUG_SIZES, DecoderArgs, tp_split_sizes
from titanlite.models.common.moe.args import MoEArgs

LAYER_KINDS = ("linear_attention", "full_attention")


def hybrid_layers(n_layers: int, interval: int = 4) -> tuple[str, ...]:
    """Every `interval`-th layer full attention, the others linear (config.json's full_attention_interval, 4: three
    Gated DeltaNet layers before each full-attention one)."""
    return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers))


@dataclass
class HybridArgs(DecoderArgs):
    """The hybrid decoder (titanlite/models/common/hybrid/model.py). Full-attention layers: per-head (1 + w) Q/K norms,
    rotations of the leading `rotary_dim` channels of each head (the shared field: head_dim x partial_rotary_factor),
    the output gated by the sigmoid of a second query projection. Linear layers: Gated DeltaNet
    (titanlite/models/common/gated_delta_net.py) with `linear_key_heads` key heads of `linear_key_dim` and
    `linear_value_heads` value heads of `linear_value_dim`, a convolution over `conv_size` tokens. Every norm of the
    blocks and the final one multiplies by (1 + w)."""

    layer_kinds: ClassVar[tuple[str, ...]] = LAYER_KINDS
    mtp_config_key: ClassVar[str] = "mtp_num_hidden_layers"  # config.json's count of mtp_layers
    qk_norm: str = "head"
    norm_eps: float = 1e-6
    rope_theta: float = 1e7
    linear_key_heads: int = 16
    linear_value_heads: int = 32
    linear_key_dim: int = 128
    linear_value_dim: int = 128
    conv_size: int = 4
    """Width of the linear layers' causal convolution (linear_conv_kernel_dim)."""
    mtp_layers: int = 0
    """Multi-token prediction (mtp_num_hidden_layers; models/common/multi_token.py): 0 or 1 depth, its block a
    full-attention layer (mtp.layers.0), its norms and projection mtp.pre_fc_norm_embedding, pre_fc_norm_hidden, fc
    and norm."""

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        if not self.layer_types:
            self.layer_types = hybrid_layers(self.n_layers)
        if self.qk_norm != "head" or self.norm_position != "pre" or self.nope_layers or self.sliding_window:
            raise ValueError(f"{name}: qk_norm is 'head', norm_position 'pre', no nope_layers or sliding window")
        if self.rope_scaling is not None or self.layer_rope:
            raise ValueError(f"{name}: the full layers rotate by rope_theta alone (no rope_scaling or layer_rope)")
        if self.linear_value_heads % self.linear_key_heads:
            raise ValueError(
                f"{name}.linear_value_heads={self.linear_value_heads} must be a multiple of "
                f"linear_key_heads={self.linear_key_heads}"
            )
        if self.conv_size < 1:
            raise ValueError(f"{name}.conv_size={self.conv_size}; it must be at least 1")
        if self.mtp_layers not in (0, 1):
            # Qwen's mtp.layers.J share one fc and its norms, which titanlite's depths (each its own) cannot say
            raise ValueError(f"{name}.mtp_layers={self.mtp_layers}; Qwen's multi-token prediction has 0 or 1 layer")


def debug_moe() -> MoEArgs:
    """The debug flavors' mixture: 8 experts of width 32, 2 per token, renormalised, a gated shared expert of 32."""
    return MoEArgs(n_experts=8, top_k=2, expert_dim=32, norm_topk_prob=True, shared_expert_dim=32, shared_gate=True)


@dataclass
class HybridMoEArgs(HybridArgs):
    """The hybrid decoder whose feed-forwards are mixtures of experts (softmax router, top-k, a shared expert scaled by
    a sigmoid gate), except at moe.dense_layers, whose MLP is ffn_dim wide."""

    moe: MoEArgs = field(default_factory=debug_moe)


def split_sizes(args: HybridArgs) -> dict[str, int]:
    """What a tensor-parallel degree must divide: the attention's heads, the MLP's width, the vocabulary, and the
    linear layers' key and value heads (each rank holds whole heads of both)."""
    return tp_split_sizes(args) | {
        "linear_key_heads": args.linear_key_heads,
        "linear_value_heads": args.linear_value_heads,
    }


def with_depth(args: HybridArgs, n_layers: int) -> dict:
    """model.n_layers: the depth, the layer pattern kept (one full layer every `interval`), the dense layers that
    still exist."""
    full = [i for i, kind in enumerate(args.layer_types) if kind == "full_attention"]
    interval = full[0] + 1 if full else n_layers + 1
    depth: dict = {"n_layers": n_layers, "layer_types": hybrid_layers(n_layers, interval)}
    if isinstance(args, HybridMoEArgs):
        dense = tuple(i for i in args.moe.dense_layers if i < n_layers)
        depth["moe"] = dataclasses.replace(args.moe, dense_layers=dense)
    return depth


# Tiny, for tests and CPU runs (DEBUG_SIZES): three linear layers and one full one, grouped value heads, partial rotary.
DEBUG_SHAPE: dict = {
    **DEBUG_SIZES,
    "head_dim": 16,
    "rotary_dim": 8,
    "max_seq_len": 2048,
    "linear_key_heads": 2,
    "linear_value_heads": 4,
    "linear_key_dim": 16,
    "linear_value_dim": 16,
}
