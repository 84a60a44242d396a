"""The Qwen hybrid decoder's arguments, torch-free: the shared decoder's with Gated DeltaNet layers
(GatedDeltaNetArgs, titanlite/models/common/linear_attention_args.py) beside gated full-attention ones (Qwen3.5's
decoder, which Qwen3.5-MoE and Qwen3-Next share), the full layers' partial rotary, multi-token prediction; the helpers
that read them. A family's folder subclasses them with its name and gives its sizes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from titanlite.models.common.decoder_args import DEBUG_SIZES
from titanlite.models.common.linear_attention_args import GatedDeltaNetArgs, full_interval, hybrid_layers
from titanlite.models.common.moe.args import MoEArgs


@dataclass
class QwenHybridArgs(GatedDeltaNetArgs):
    """The Qwen hybrid decoder (titanlite/models/common/qwen_hybrid/model.py). Full-attention layers: per-head (1 + w)
    Q/K norms, rotations of the leading `rotary_dim` channels of each head (the shared field: head_dim x
    partial_rotary_factor), the output gated by the sigmoid of a second query projection. Linear layers: Gated
    DeltaNet (their shape: GatedDeltaNetArgs, whose defaults are Qwen3.5's). Every norm of the blocks and the final one
    multiplies by (1 + w)."""

    mtp_config_key: ClassVar[str] = "mtp_num_hidden_layers"  # config.json's count of mtp_layers
    qk_norm: str = "head"
    norm_eps: float = 1e-6
    rope_theta: float = 1e7
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
        if self.mtp_layers not in (0, 1):
            # Qwen's mtp.layers.J share one fc and its norms, which titanlite's depths (each its own) cannot say
            raise ValueError(f"{name}.mtp_layers={self.mtp_layers}; Qwen's multi-token prediction has 0 or 1 layer")


def debug_moe() -> MoEArgs:
    """The debug flavors' mixture: 8 experts of width 32, 2 per token, renormalised, a gated shared expert of 32."""
    return MoEArgs(n_experts=8, top_k=2, expert_dim=32, norm_topk_prob=True, shared_expert_dim=32, shared_gate=True)


@dataclass
class QwenHybridMoEArgs(QwenHybridArgs):
    """The hybrid decoder whose feed-forwards are mixtures of experts (softmax router, top-k, a shared expert scaled by
    a sigmoid gate), except at moe.dense_layers, whose MLP is ffn_dim wide."""

    moe: MoEArgs = field(default_factory=debug_moe)


def with_depth(args: QwenHybridArgs, n_layers: int) -> dict:
    """model.n_layers: the depth, the layer pattern kept (one full layer every `interval`), the dense layers that
    still exist."""
    interval = full_interval(args.layer_types, n_layers + 1)
    depth: dict = {"n_layers": n_layers, "layer_types": hybrid_layers(n_layers, interval)}
    if isinstance(args, QwenHybridMoEArgs):
        depth["moe"] = args.moe.at_depth(n_layers)
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
