"""Qwen3: the Llama decoder with an RMSNorm of each query and key head before RoPE (one weight of head_dim
shared by the heads), head_dim 128. Its sizes, its config.json and its spec."""

from __future__ import annotations

from titanlite.models.common.decoder_args import DecoderArgs, debug, sizes
from titanlite.models.common.decoder_config import (
    DecoderConfig,
    Expressible,
    attention_biases,
    no_mlp_bias,
    window_fields,
    window_if_used,
)
from titanlite.models.common.decoder_spec import decoder_spec


def _qwen3(dim, n_layers, n_heads, n_kv_heads, ffn_dim, tie, vocab_size=151936) -> DecoderArgs:
    return DecoderArgs(
        **sizes(dim, n_layers, n_heads, n_kv_heads, ffn_dim),
        vocab_size=vocab_size,
        max_seq_len=40960,
        rope_theta=1e6,
        norm_eps=1e-6,
        tie_embeddings=tie,
        head_dim=128,
        family="qwen3",
        qk_norm="head",
    )


FLAVORS = {
    "debug": debug("qwen3", head_dim=32, qk_norm="head"),
    "qwen3_0.6b": _qwen3(1024, 28, 16, 8, 3072, tie=True),
    "qwen3_1.7b": _qwen3(2048, 28, 16, 8, 6144, tie=True),
    "qwen3_4b": _qwen3(2560, 36, 32, 8, 9728, tie=True),
    "qwen3_8b": _qwen3(4096, 36, 32, 8, 12288, tie=False),
}


def switches(config: dict, n_layers: int, where: str) -> dict:
    no_mlp_bias("qwen3", config, where)
    return attention_biases(config, n_layers, where) | {"qk_norm": "head"}


HF = DecoderConfig(
    family="qwen3",
    model_type="qwen3",
    architecture="Qwen3ForCausalLM",
    expressible=Expressible(mlp_bias=False, qk_norm="head"),
    switches=switches,
    window=window_if_used(28),  # transformers' default max_window_layers where config.json has none
    fields=window_fields,
)
SPEC = decoder_spec("qwen3", FLAVORS, HF, "Qwen3: the Llama decoder with per-head Q/K RMSNorm")
