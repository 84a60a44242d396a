"""Qwen2 and Qwen2.5: the Llama decoder with biases on the query, key and value projections. Its sizes,
its config.json and its spec."""

from __future__ import annotations

from titanlite.models.common.decoder_args import DecoderArgs, debug, sizes
from titanlite.models.common.decoder_config import (
    DecoderConfig,
    Expressible,
    no_mlp_bias,
    window_fields,
    window_if_used,
)
from titanlite.models.common.decoder_spec import decoder_spec


def _qwen2(dim, n_layers, n_heads, n_kv_heads, ffn_dim, vocab_size, tie) -> DecoderArgs:
    return DecoderArgs(
        **sizes(dim, n_layers, n_heads, n_kv_heads, ffn_dim),
        vocab_size=vocab_size,
        max_seq_len=32768,
        rope_theta=1e6,
        norm_eps=1e-6,
        tie_embeddings=tie,
        family="qwen2",
        qkv_bias=True,
    )


FLAVORS = {
    "debug": debug("qwen2", qkv_bias=True),
    "qwen2.5_0.5b": _qwen2(896, 24, 14, 2, 4864, 151936, tie=True),
    "qwen2.5_1.5b": _qwen2(1536, 28, 12, 2, 8960, 151936, tie=True),
    "qwen2.5_7b": _qwen2(3584, 28, 28, 4, 18944, 152064, tie=False),
}


def switches(config: dict, n_layers: int, where: str) -> dict:
    """Biases on q, k and v only, whatever the config says (Qwen2Attention hard-codes them)."""
    no_mlp_bias("qwen2", config, where)
    return {"qkv_bias": True, "out_bias": False, "mlp_bias": False}


HF = DecoderConfig(
    family="qwen2",
    model_type="qwen2",
    architecture="Qwen2ForCausalLM",
    expressible=Expressible(qkv_bias=True, out_bias=False, mlp_bias=False),
    switches=switches,
    window=window_if_used(28),  # transformers' default max_window_layers where config.json has none
    fields=window_fields,
    attention_bias_field=False,
)
SPEC = decoder_spec("qwen2", FLAVORS, HF, "Qwen2/2.5: the Llama decoder with q/k/v biases")
