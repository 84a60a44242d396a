"""Gemma 3's weights under Hugging Face's names (Gemma3ForCausalLM): Llama's, with the four norms of a block, and
the same RoPE row order change (ours rotates adjacent pairs, Hugging Face's halves of each head)."""

from __future__ import annotations

import torch

from titanlite.models.common import decoder_weights as llama
from titanlite.models.gemma3.args import Gemma3Args


def hf_names(args: Gemma3Args) -> dict[str, str]:
    """Our parameter name -> the HF name (output.weight included even when tied)."""
    names = llama.hf_names(args)
    norms = {
        "attention_norm": "input_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffn_norm": "post_feedforward_layernorm",
    }
    for i in range(args.n_layers):
        for ours, hf in norms.items():
            names[f"layers.{i}.{ours}.weight"] = f"model.layers.{i}.{hf}.weight"
    return names


def hf_keys(args: Gemma3Args, keys: list[str]) -> dict[str, str]:
    return {k: k for k in keys}


def hf_sources(args: Gemma3Args) -> dict[str, str]:
    return hf_names(args)


def to_hf(args: Gemma3Args, sd: dict[str, torch.Tensor], take) -> dict[str, torch.Tensor]:
    """Llama's conversion under Gemma 3's names."""
    return llama.to_hf(args, sd, take, hf_names(args))


def from_hf_tensor(args: Gemma3Args, name: str, hf: torch.Tensor) -> torch.Tensor:
    return llama.from_hf_tensor(args, name, hf)
