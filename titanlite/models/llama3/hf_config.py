"""Llama 3's config.json both ways: the shared decoder's DecoderConfig (titanlite/models/common/decoder_config.py)
with Llama's names."""

from __future__ import annotations

from titanlite.models.common.decoder_config import DecoderConfig

LLAMA = DecoderConfig(
    family="llama3",
    model_type="llama",
    architecture="LlamaForCausalLM",
    fields=lambda args: {"mlp_bias": args.mlp_bias, "pretraining_tp": 1},
)
