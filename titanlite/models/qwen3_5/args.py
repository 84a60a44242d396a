"""Qwen3.5's arguments, torch-free: the hybrid decoder's (titanlite/models/common/qwen_hybrid/args.py) under its name,
and the published sizes of its dense text models."""

from __future__ import annotations

from dataclasses import dataclass

from titanlite.models.common.decoder_args import sizes
from titanlite.models.common.qwen_hybrid.args import DEBUG_SHAPE, QwenHybridArgs
from titanlite.models.spec import not_math


@dataclass
class Qwen35Args(QwenHybridArgs):
    """Qwen3.5's text decoder: three Gated DeltaNet layers before each gated full-attention layer."""

    family: str = not_math("qwen3_5")


def _dense(dim, n_layers, n_heads, n_kv_heads, ffn_dim, value_heads, tie) -> Qwen35Args:
    return Qwen35Args(
        **sizes(dim, n_layers, n_heads, n_kv_heads, ffn_dim),
        vocab_size=248320,
        max_seq_len=262144,
        head_dim=256,
        rotary_dim=64,
        tie_embeddings=tie,
        linear_key_heads=16,
        linear_value_heads=value_heads,
    )


# The text models of Qwen/Qwen3.5-* (their config.json text_config).
FLAVORS = {
    "debug": Qwen35Args(**DEBUG_SHAPE),
    # The debug model with gated full attention at every layer: the baseline the hybrid's linear layers are measured
    # against (BENCHMARKS.md).
    "debug_full": Qwen35Args(**DEBUG_SHAPE, layer_types=("full_attention",) * DEBUG_SHAPE["n_layers"]),
    "qwen3_5_0.8b": _dense(1024, 24, 8, 2, 3584, 16, tie=True),
    "qwen3_5_2b": _dense(2048, 24, 8, 2, 6144, 16, tie=True),
    "qwen3_5_4b": _dense(2560, 32, 16, 4, 9216, 32, tie=True),
    "qwen3_5_9b": _dense(4096, 32, 16, 4, 12288, 32, tie=False),
    "qwen3_5_27b": _dense(5120, 64, 24, 4, 17408, 48, tie=False),
}
