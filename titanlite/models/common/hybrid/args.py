"""Qwen3.5's arguments, torch-free: the shared decoder's (DecoderArgs) with its layer kinds (Gated DeltaNet linear
attention and gated full attention), the linear layers' shape and the full layers' partial rotary; the published
sizes of the dense models and of the mixtures of experts (Qwen3.5-MoE)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

from titanlite.models.common.decoder_args import DecoderArgs, tp_split_sizes
from titanlite.models.common.moe.args import MoEArgs
from titanlite.models.spec import not_math

LAYER_KINDS = ("linear_attention", "full_attention")


def hybrid_layers(n_layers: int, interval: int = 4) -> tuple[str, ...]:
    """Every `interval`-th layer full attention, the others linear (config.json's full_attention_interval, 4: three
    Gated DeltaNet layers before each full-attention one)."""
    return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers))


@dataclass
class Qwen35Args(DecoderArgs):
    """Qwen3.5's text decoder (titanlite/models/qwen3_5/model.py). Full-attention layers: per-head (1 + w) Q/K norms,
    rotations of the leading `rotary_dim` channels of each head, the output gated by the sigmoid of a second query
    projection. Linear layers: Gated DeltaNet (titanlite/models/common/gated_delta_net.py) with `linear_key_heads`
    key heads of `linear_key_dim` and `linear_value_heads` value heads of `linear_value_dim`, a convolution over
    `conv_size` tokens. Every norm of the blocks and the final one multiplies by (1 + w)."""

    layer_kinds: ClassVar[tuple[str, ...]] = LAYER_KINDS
    family: str = not_math("qwen3_5")
    qk_norm: str = "head"
    norm_eps: float = 1e-6
    rope_theta: float = 1e7
    rotary_dim: int = 0
    """Channels of each full-attention head that rotate (head_dim x partial_rotary_factor); 0: head_dim."""
    linear_key_heads: int = 16
    linear_value_heads: int = 32
    linear_key_dim: int = 128
    linear_value_dim: int = 128
    conv_size: int = 4
    """Width of the linear layers' causal convolution (linear_conv_kernel_dim)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.rotary_dim:
            self.rotary_dim = self.head_dim
        if not self.layer_types:
            self.layer_types = hybrid_layers(self.n_layers)
        if self.qk_norm != "head" or self.norm_position != "pre" or self.nope_layers or self.sliding_window:
            raise ValueError("Qwen35Args: qk_norm is 'head', norm_position 'pre', no nope_layers or sliding window")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"Qwen35Args.rotary_dim={self.rotary_dim}; use an even number up to head_dim")
        if self.linear_value_heads % self.linear_key_heads:
            raise ValueError(
                f"Qwen35Args.linear_value_heads={self.linear_value_heads} must be a multiple of "
                f"linear_key_heads={self.linear_key_heads}"
            )
        if self.conv_size < 1:
            raise ValueError(f"Qwen35Args.conv_size={self.conv_size}; it must be at least 1")


def _debug_moe() -> MoEArgs:
    return MoEArgs(n_experts=8, top_k=2, expert_dim=32, norm_topk_prob=True, shared_expert_dim=32, shared_gate=True)


@dataclass
class Qwen35MoEArgs(Qwen35Args):
    """Qwen3.5-MoE: Qwen3.5's decoder whose every feed-forward is a mixture of experts (softmax router, top-k
    renormalised, one shared expert scaled by a sigmoid gate)."""

    family: str = not_math("qwen3_5_moe")
    moe: MoEArgs = field(default_factory=_debug_moe)


def split_sizes(args: Qwen35Args) -> dict[str, int]:
    """What a tensor-parallel degree must divide: the attention's heads, the MLP's width, the vocabulary, and the
    linear layers' key and value heads (each rank holds whole heads of both)."""
    return tp_split_sizes(args) | {
        "linear_key_heads": args.linear_key_heads,
        "linear_value_heads": args.linear_value_heads,
    }


def with_depth(args: Qwen35Args, n_layers: int) -> dict:
    """model.n_layers: the depth, the layer pattern kept (one full layer every `interval`)."""
    full = [i for i, kind in enumerate(args.layer_types) if kind == "full_attention"]
    interval = full[0] + 1 if full else n_layers + 1
    depth: dict = {"n_layers": n_layers, "layer_types": hybrid_layers(n_layers, interval)}
    if isinstance(args, Qwen35MoEArgs):
        dense = tuple(i for i in args.moe.dense_layers if i < n_layers)
        depth["moe"] = dataclasses.replace(args.moe, dense_layers=dense)
    return depth


def _dense(dim, n_layers, n_heads, n_kv_heads, ffn_dim, value_heads, tie) -> Qwen35Args:
    return Qwen35Args(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        ffn_dim=ffn_dim,
        vocab_size=248320,
        max_seq_len=262144,
        head_dim=256,
        rotary_dim=64,
        tie_embeddings=tie,
        linear_key_heads=16,
        linear_value_heads=value_heads,
    )


def _moe(dim, n_layers, n_heads, experts, top_k, expert_dim, value_heads) -> Qwen35MoEArgs:
    return Qwen35MoEArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=2,
        ffn_dim=expert_dim,
        vocab_size=248320,
        max_seq_len=262144,
        head_dim=256,
        rotary_dim=64,
        linear_key_heads=16,
        linear_value_heads=value_heads,
        moe=MoEArgs(
            n_experts=experts,
            top_k=top_k,
            expert_dim=expert_dim,
            norm_topk_prob=True,
            shared_expert_dim=expert_dim,
            shared_gate=True,
        ),
    )


_DEBUG: dict = {
    "dim": 64,
    "n_layers": 4,
    "n_heads": 4,
    "n_kv_heads": 2,
    "ffn_dim": 192,
    "vocab_size": 0,
    "head_dim": 16,
    "rotary_dim": 8,
    "max_seq_len": 2048,
    "linear_key_heads": 2,
    "linear_value_heads": 4,
    "linear_key_dim": 16,
    "linear_value_dim": 16,
}

# The text models of Qwen/Qwen3.5-* (their config.json text_config). vocab_size 0 (debug): the tokenizer's, padded.
FLAVORS = {
    # Tiny, for tests and CPU runs: three linear layers and one full one, grouped value heads, partial rotary.
    "debug": Qwen35Args(**_DEBUG),
    "qwen3_5_0.8b": _dense(1024, 24, 8, 2, 3584, 16, tie=True),
    "qwen3_5_2b": _dense(2048, 24, 8, 2, 6144, 16, tie=True),
    "qwen3_5_4b": _dense(2560, 32, 16, 4, 9216, 32, tie=True),
    "qwen3_5_9b": _dense(4096, 32, 16, 4, 12288, 32, tie=False),
    "qwen3_5_27b": _dense(5120, 64, 24, 4, 17408, 48, tie=False),
}

MOE_FLAVORS = {
    "debug": Qwen35MoEArgs(**_DEBUG),
    "qwen3_5_moe_35b_a3b": _moe(2048, 40, 16, 256, 8, 512, 32),
    "qwen3_5_moe_122b_a10b": _moe(3072, 48, 32, 256, 8, 1024, 64),
    "qwen3_5_moe_397b_a17b": _moe(4096, 60, 32, 512, 10, 1024, 64),
}
