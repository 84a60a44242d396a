"""Falcon-H1's weights under Hugging Face's names (FalconH1ForCausalLM, model.*), both ways.

Each layer: input_layernorm and pre_ff_layernorm (our attention_norm and ffn_norm); self_attn's q_proj, k_proj, v_proj
and o_proj, whose query and key rows are reordered between transformers' rotate-half RoPE and our adjacent pairs
(decoder_weights.rope_from_hf, rope_to_hf); feed_forward's gate_proj, up_proj and down_proj (w1, w3, w2); mamba's
in_proj, whose rows are [z | x | B | C | dt] (our wz, wx, wb, wc, wdt), conv1d's [x | B | C] channels, weight
[C, 1, K] (our conv_x, conv_b, conv_c [C, K] and their biases), A_log, D, dt_bias, the gated norm (where
mamba_rms_norm) and out_proj one to one. The ends: embed_tokens, final_layernorm and lm_head."""

from __future__ import annotations

import torch

from titanlite.models.common import decoder_weights
from titanlite.models.common.mamba2_weights import Fusing, from_fused, mamba_sources
from titanlite.models.falcon_h1.args import FalconH1Args

ATTENTION = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}
MLP = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _leaves(bias: bool) -> tuple[str, ...]:
    return ("weight", "bias") if bias else ("weight",)


def hf_sources(args: FalconH1Args) -> dict[str, str]:
    """Our parameter name -> the Hugging Face tensor it is made from (output.weight included even when tied)."""
    names = {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.final_layernorm.weight",
        "output.weight": "lm_head.weight",
    }
    for i in range(args.n_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        names[f"{ours}attention_norm.weight"] = f"{hf}input_layernorm.weight"
        names[f"{ours}ffn_norm.weight"] = f"{hf}pre_ff_layernorm.weight"
        for o, h in ATTENTION.items():
            names |= {f"{ours}attention.{o}.{leaf}": f"{hf}self_attn.{h}.{leaf}" for leaf in _leaves(args.qkv_bias)}
        for o, h in MLP.items():
            names |= {
                f"{ours}feed_forward.{o}.{leaf}": f"{hf}feed_forward.{h}.{leaf}" for leaf in _leaves(args.mlp_bias)
            }
        names |= mamba_sources(
            args, f"{ours}mamba.", f"{hf}mamba.", out_bias=args.mamba_out_bias, gated_norm=args.mamba_gated_norm
        )
    return names


def hf_keys(args: FalconH1Args, keys: list[str]) -> dict[str, str]:
    """A folder's tensor names as the stored ones: the same (transformers saves Falcon-H1 under its module names)."""
    return {k: k for k in keys}


def from_hf_tensor(args: FalconH1Args, name: str, hf: torch.Tensor) -> torch.Tensor:
    """Our parameter `name`'s full value from its Hugging Face tensor (hf_sources[name])."""
    part = from_fused(args, name.partition(".mamba.")[2], hf) if ".mamba." in name else None
    return decoder_weights.from_hf_tensor(args, name, hf).contiguous() if part is None else part


def to_hf(args: FalconH1Args, sd: dict[str, torch.Tensor], take) -> dict[str, torch.Tensor]:
    """Our state dict -> Hugging Face's names and layouts (lm_head.weight always present); `take(name)` reads sd."""
    fusing = Fusing()
    out: dict[str, torch.Tensor] = {}
    for ours, hf in hf_sources(args).items():
        mamba = ".mamba." in ours and fusing.add(args, ours.partition(".mamba.")[2], hf, take(ours))
        if not mamba:
            out[hf] = decoder_weights.to_hf_tensor(args, ours, take(ours))
    return out | fusing.tensors()
