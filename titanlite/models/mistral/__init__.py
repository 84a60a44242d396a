"""Mistral: the Llama decoder as it is, with its own config.json (and a sliding window that titanlite keeps
the context within). Its sizes and its spec."""

from __future__ import annotations

from titanlite.models.common.decoder_args import DecoderArgs, debug
from titanlite.models.common.decoder_config import (
    DecoderConfig,
    Expressible,
    attention_biases,
    no_mlp_bias,
    window_always,
)
from titanlite.models.common.decoder_spec import decoder_spec

FLAVORS = {
    "debug": debug("mistral"),
    # Mistral 7B v0.3: no sliding window.
    "mistral_7b": DecoderArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        vocab_size=32768,
        max_seq_len=32768,
        rope_theta=1e6,
        norm_eps=1e-5,
        family="mistral",
    ),
}


def switches(config: dict, n_layers: int, where: str) -> dict:
    no_mlp_bias("mistral", config, where)
    return attention_biases(config, n_layers, where)


HF = DecoderConfig(
    family="mistral",
    model_type="mistral",
    architecture="MistralForCausalLM",
    expressible=Expressible(qkv_bias=False, out_bias=False, mlp_bias=False),
    switches=switches,
    window=window_always,
    fields=lambda args: {"sliding_window": args.sliding_window or None},
)
SPEC = decoder_spec("mistral", FLAVORS, HF, "Mistral: the Llama decoder, its own config.json")
