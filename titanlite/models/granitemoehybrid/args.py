"""Granite 4.0 H's arguments, torch-free: the shared decoder's with Mamba-2 layers (Mamba2Args,
titanlite/models/common/mamba2_args.py) beside grouped-query attention, as `layer_types` says; in every layer a
mixture of experts with a shared SwiGLU MLP beside it (or the shared MLP alone), and the muP-style multipliers of the
embeddings, the attention scores, the residual adds and the logits; the published sizes."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from titanlite.models.common.mamba2_args import Mamba2Args
from titanlite.models.common.moe.args import MoEArgs
from titanlite.models.spec import not_math

LAYER_KINDS = ("mamba", "full_attention")


@dataclass
class GraniteMoeHybridArgs(Mamba2Args):
    """Granite 4.0 H's decoder (titanlite/models/granitemoehybrid/model.py): n_layers layers, each a mixer of
    `layer_types`' kind ("mamba": a Mamba-2 mixer; "full_attention": grouped-query attention, its scores scaled by
    attention_multiplier, rotated only where `rope`) then `moe`'s mixture of experts with its shared expert, the
    SwiGLU of width ffn_dim (config.json's shared_intermediate_size), beside it (no `moe`: that MLP alone); each
    sublayer behind its own RMSNorm, its output times residual_multiplier before the residual add. The embeddings are
    multiplied by embedding_multiplier, the logits divided by logits_scaling. The Mamba-2 output norm is grouped by
    mamba_groups, as transformers' is."""

    layer_kinds: ClassVar[tuple[str, ...]] = LAYER_KINDS
    family: str = not_math("granitemoehybrid")
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    mamba_groups: int = 1
    state_dim: int = 256
    mamba_chunk_size: int = not_math(256)
    rope: bool = False
    """Rotate the attention layers' queries and keys (position_embedding_type "rope"); False: no positions but the
    causal order ("nope", Granite 4.0 H's)."""
    embedding_multiplier: float = 1.0
    """The token embeddings are multiplied by it."""
    attention_multiplier: float = 1.0
    """The attention scores' scale, in place of head_dim**-0.5."""
    residual_multiplier: float = 1.0
    """Each sublayer's output is multiplied by it before the residual add."""
    logits_scaling: float = 1.0
    """The logits are divided by it."""
    moe: MoEArgs | None = None
    """Every layer's mixture of experts (softmax router, top-k renormalised, SwiGLU experts) with the shared MLP as its
    shared expert (shared_expert_dim = ffn_dim); None: the shared MLP alone (num_local_experts 0)."""

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = ("mamba",) * self.n_layers  # transformers' default: every layer Mamba-2
        super().__post_init__()
        name = type(self).__name__
        if self.qk_norm != "none" or self.norm_position != "pre" or self.mlp_bias or self.qkv_bias != self.out_bias:
            raise ValueError(f"{name}: pre-norm layers, no Q/K norms, no MLP biases, one attention bias for q/k/v/o")
        if self.sliding_window or self.nope_layers or self.layer_rope or self.rotary_dim != self.head_dim:
            raise ValueError(f"{name}: attention over the whole sequence, every head's channels rotated where `rope`")
        if self.rope and self.head_dim % 2:
            raise ValueError(f"{name}.head_dim={self.head_dim}: RoPE rotates pairs, so it must be even")
        if self.mamba_norm_groups != self.mamba_groups:
            raise ValueError(f"{name}.mamba_norm_groups={self.mamba_norm_groups}: the gated norm is grouped by "
                             f"mamba_groups={self.mamba_groups}")  # fmt: skip
        if not self.logits_scaling:
            raise ValueError(f"{name}.logits_scaling=0: the logits are divided by it")
        if self.moe is not None:
            self.moe.check_depth(self.n_layers)
            if self.moe.dense_layers or self.moe.shared_hidden != self.ffn_dim:
                raise ValueError(
                    f"{name}.moe: every layer holds the experts (no dense_layers) with the shared MLP of ffn_dim="
                    f"{self.ffn_dim} as its shared expert (shared_expert_dim)"
                )


def with_depth(args: GraniteMoeHybridArgs, n_layers: int) -> dict:
    """model.n_layers: the depth, the layer pattern repeated (or cut) to it."""
    kinds = args.layer_types
    return {"n_layers": n_layers, "layer_types": (kinds * math.ceil(n_layers / len(kinds)))[:n_layers]}


def granite_layers(attention: tuple[int, ...], n_layers: int) -> tuple[str, ...]:
    """`n_layers` layer kinds: attention at the `attention` indices, Mamba-2 elsewhere."""
    return tuple("full_attention" if i in attention else "mamba" for i in range(n_layers))


# The published Granite 4.0 H models (Small, Tiny: hybrid MoE; Micro: hybrid dense) have 40 layers, attention at 5,
# 15, 25 and 35 ("4 attention / 36 Mamba2", no positions), the tokenizer's 100352 ids tied to the output head. Their
# sizes are the architecture table of IBM's model cards (the README of ibm-granite's Hugging Face folders); the
# multipliers, norm epsilon, B/C groups and Mamba widths of Small and Tiny are the GGUF metadata of IBM's own
# conversions (Ollama's ibm/granite4:small-h and granite4:tiny-h: attention.scale, embedding_scale, residual_scale,
# logit_scale, ssm.group_count, ssm.inner_size, ssm.state_size, ssm.time_step_rank). Small's parameters total its
# safetensors index's 32,207,337,984 (tests/unit/test_granitemoehybrid.py). Micro's multipliers (embedding 12,
# attention 1/64, logits 8) are those of a Hub config.json of H Micro's shapes (a fine-tune's); its residual
# multiplier, 0.22, and its vocabulary are those of every other Granite 4.0 model of 1B parameters and up, not read
# from a config.json of its own.
GRANITE_4_0_H = granite_layers((5, 15, 25, 35), 40)
PUBLISHED: dict[str, Any] = {
    "n_layers": 40,
    "layer_types": GRANITE_4_0_H,
    "vocab_size": 100352,
    "max_seq_len": 131072,
    "norm_eps": 1e-5,
    "tie_embeddings": True,
    "state_dim": 128,
    "mamba_groups": 1,
    "mamba_head_dim": 64,
    "embedding_multiplier": 12.0,
    "residual_multiplier": 0.22,
}
FLAVORS = {
    # Tiny, for tests and CPU runs: Mamba-2 and attention layers, grouped B and C and grouped key/value heads, 8
    # experts (2 per token) beside the shared MLP, every multiplier other than one.
    "debug": GraniteMoeHybridArgs(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=96,
        vocab_size=0,
        max_seq_len=2048,
        norm_eps=1e-5,
        layer_types=("mamba", "full_attention", "mamba", "mamba"),
        mamba_heads=8,
        mamba_head_dim=16,
        mamba_groups=2,
        state_dim=16,
        mamba_chunk_size=16,
        embedding_multiplier=12.0,
        attention_multiplier=1 / 16,
        residual_multiplier=0.22,
        logits_scaling=2.0,
        moe=MoEArgs(n_experts=8, top_k=2, expert_dim=32, norm_topk_prob=True, shared_expert_dim=96),
    ),
    "granite_4_0_h_small": GraniteMoeHybridArgs(
        **PUBLISHED,
        dim=4096,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=1536,
        mamba_heads=128,
        attention_multiplier=0.0078125,
        logits_scaling=16.0,
        moe=MoEArgs(n_experts=72, top_k=10, expert_dim=768, norm_topk_prob=True, shared_expert_dim=1536),
    ),
    "granite_4_0_h_tiny": GraniteMoeHybridArgs(
        **PUBLISHED,
        dim=1536,
        n_heads=12,
        n_kv_heads=4,
        ffn_dim=1024,
        mamba_heads=48,
        attention_multiplier=0.0078125,
        logits_scaling=6.0,
        moe=MoEArgs(n_experts=64, top_k=6, expert_dim=512, norm_topk_prob=True, shared_expert_dim=1024),
    ),
    "granite_4_0_h_micro": GraniteMoeHybridArgs(
        **PUBLISHED,
        dim=2048,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=8192,
        mamba_heads=64,
        attention_multiplier=0.015625,
        logits_scaling=8.0,
    ),
}
