"""OLMo Hybrid's weights under Hugging Face's names (OlmoHybridForCausalLM), both ways, as a folder holds them: the
published checkpoints' names, which transformers' save_pretrained writes back (its conversion_mapping renames and
concatenates them on load).

Linear layers: q_proj, k_proj, v_proj, a_proj, b_proj, g_proj, o_proj, A_log, dt_bias and o_norm one to one; the
convolutions q_conv1d, k_conv1d, v_conv1d [C, 1, K] our conv_q, conv_k, conv_v [C, K]; the block's norms
attention_layer_norm and feedforward_layer_norm (transformers' input_layernorm and post_attention_layernorm).
Attention layers: OLMo 2's tensors, the post-attention norm stored as feedforward_layer_norm as save_pretrained
renames it, the query and key rows (and their whole-projection norms' weights) reordered between Hugging Face's
rotate-half layout and our adjacent pairs where the model rotates. A folder holding transformers' own norm names
(input_layernorm, post_attention_layernorm) reads the same."""

from __future__ import annotations

import torch

from titanlite.models.common import decoder_weights as llama
from titanlite.models.olmo_hybrid.args import OlmoHybridArgs

LINEAR = {  # ours (under attention.) -> Hugging Face's (under linear_attn.)
    "wq.weight": "q_proj.weight",
    "wk.weight": "k_proj.weight",
    "wv.weight": "v_proj.weight",
    "conv_q": "q_conv1d.weight",
    "conv_k": "k_conv1d.weight",
    "conv_v": "v_conv1d.weight",
    "wa.weight": "a_proj.weight",
    "wb.weight": "b_proj.weight",
    "wz.weight": "g_proj.weight",
    "A_log": "A_log",
    "dt_bias": "dt_bias",
    "norm.weight": "o_norm.weight",
    "wo.weight": "o_proj.weight",
}
ATTENTION = {  # ours (under attention.) -> Hugging Face's (under self_attn.)
    "wq.weight": "q_proj.weight",
    "wk.weight": "k_proj.weight",
    "wv.weight": "v_proj.weight",
    "wo.weight": "o_proj.weight",
    "q_norm.weight": "q_norm.weight",
    "k_norm.weight": "k_norm.weight",
}
NORMS = {  # a layer kind -> the Hugging Face names of its attention_norm and ffn_norm
    "linear_attention": ("attention_layer_norm", "feedforward_layer_norm"),
    "full_attention": ("feedforward_layer_norm", "post_feedforward_layernorm"),
}
# transformers' module names -> the stored ones (its conversion_mapping's renames, reversed)
RENAMED = {"input_layernorm": "attention_layer_norm", "post_attention_layernorm": "feedforward_layer_norm"}


def hf_sources(args: OlmoHybridArgs) -> dict[str, str]:
    """Our parameter name -> the Hugging Face tensor it is made from (output.weight included even when tied)."""
    names = {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    for i, kind in enumerate(args.layer_types):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        for norm, stored in zip(("attention_norm", "ffn_norm"), NORMS[kind]):
            names[f"{ours}{norm}.weight"] = f"{hf}{stored}.weight"
        mixer, where = (LINEAR, "linear_attn.") if kind == "linear_attention" else (ATTENTION, "self_attn.")
        names |= {f"{ours}attention.{o}": hf + where + h for o, h in mixer.items()}
        for w, proj in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            names[f"{ours}feed_forward.{w}.weight"] = f"{hf}mlp.{proj}.weight"
    return names


def hf_keys(args: OlmoHybridArgs, keys: list[str]) -> dict[str, str]:
    """A folder's tensor names as the stored ones: transformers' module names of the block norms renamed."""
    view = {}
    for key in keys:
        name = key
        for module, stored in RENAMED.items():
            name = name.replace(f".{module}.", f".{stored}.")
        view[name] = key
    return view


def _rope_heads(args: OlmoHybridArgs, ours: str) -> int | None:
    """How many heads a rotating tensor's rows hold (None: not one, or the model does not rotate)."""
    if not args.rope or not ours.startswith("layers.") or args.layer_types[int(ours.split(".")[1])] != "full_attention":
        return None
    return llama.rope_heads(args, ours)


def from_hf_tensor(args: OlmoHybridArgs, name: str, hf: torch.Tensor) -> torch.Tensor:
    """Our parameter `name`'s full value from its Hugging Face tensor (hf_sources[name])."""
    if name.rpartition(".")[2] in ("conv_q", "conv_k", "conv_v"):
        return hf.squeeze(1).contiguous()
    heads = _rope_heads(args, name)
    return hf.contiguous() if heads is None else llama.rope_from_hf(hf, heads).contiguous()


def to_hf(args: OlmoHybridArgs, sd: dict[str, torch.Tensor], take) -> dict[str, torch.Tensor]:
    """Our state dict -> Hugging Face's names and layouts (lm_head.weight always present); `take(name)` reads sd."""
    out = {}
    for ours, hf in hf_sources(args).items():
        if ours.rpartition(".")[2] in ("conv_q", "conv_k", "conv_v"):
            out[hf] = take(ours).unsqueeze(1)
            continue
        heads = _rope_heads(args, ours)
        out[hf] = take(ours) if heads is None else llama.rope_to_hf(take(ours), heads)
    return out
