"""MiniMax-M2's weights under its folders' names (MiniMaxM2ForCausalLM's checkpoint files, as the published ones and
transformers' save_pretrained write them), both ways: the Llama decoder's attention and norms (self_attn.q_norm and
k_norm over the whole projection), and at every layer block_sparse_moe.gate.weight (the router),
block_sparse_moe.e_score_correction_bias (our routing bias, a buffer) and block_sparse_moe.experts.E.{w1,w3,w2}
(gate, up, down: stacked into our experts.w1, w3, w2). The rotating rows of each query and key head (its leading
rotary_dim, and the Q/K norms' weights on them) are reordered between Hugging Face's rotate-half layout and our
adjacent pairs, the rest kept, as the Llama decoder's conversion does (decoder_weights.rotary_rows). Multi-token
prediction layers a folder may hold (model.layers.N past the decoder's, or mtp.*: the published folders hold none)
are not trained: carried unchanged into an export (hf_carried)."""

from __future__ import annotations

import re

import torch

from titanlite.models.common import decoder_weights as llama
from titanlite.models.common.moe.layer import moe_to_hf
from titanlite.models.common.moe.weights import from_hf_tensor as moe_from_hf_tensor
from titanlite.models.common.moe.weights import naming
from titanlite.models.minimax_m2.args import MiniMaxM2Args

_BLOCK = naming("block_sparse_moe", "w1")
_BIAS = "router.expert_bias"
# The config.json fields of multi-token prediction an export keeps from the folder it started from.
MTP_FIELDS = ("use_mtp", "num_mtp_modules", "mtp_transformer_layers")


def hf_sources(args: MiniMaxM2Args) -> dict[str, str | tuple[str, ...]]:
    """Our parameter (and routing-bias buffer) name -> the HF tensor it is made from; a stacked expert tensor ->
    its experts' tensors, in expert order."""
    sources = _BLOCK.hf_sources(args)
    if args.moe.balance == "bias":
        for i in range(args.n_layers):
            sources[f"layers.{i}.feed_forward.{_BIAS}"] = f"model.layers.{i}.block_sparse_moe.e_score_correction_bias"
    return sources


def hf_keys(args: MiniMaxM2Args, keys: list[str]) -> dict[str, str]:
    return {k: k for k in keys}


def hf_carried(args: MiniMaxM2Args, keys: list[str]) -> list[str]:
    """Multi-token prediction layers (model.layers.N for N past the decoder's, as MiniMax's inference code names
    them, or mtp.*): not trained here, carried unchanged into an export (titanlite/components/hf_weights.py)."""

    def past_the_decoder(key: str) -> bool:
        layer = re.match(r"model\.layers\.(\d+)\.", key)
        return layer is not None and int(layer.group(1)) >= args.n_layers

    return [k for k in keys if past_the_decoder(k) or k.startswith("mtp.")]


def hf_folder(args: MiniMaxM2Args, config: dict, tensors: dict, source: dict) -> tuple[dict, dict]:
    """An export from a folder says of multi-token prediction what the folder said (its MTP layers, if it held any,
    are carried into the export)."""
    return config | {k: source[k] for k in MTP_FIELDS if k in source}, tensors


def from_hf_tensor(args: MiniMaxM2Args, name: str, hf: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """Our tensor `name`'s full value from its HF tensor, or from its experts' tensors (hf_sources[name])."""
    if isinstance(hf, list):
        return moe_from_hf_tensor(args, name, hf)
    if name.endswith(_BIAS):
        return hf.float()
    return llama.from_hf_tensor(args, name, hf)


def to_hf(args: MiniMaxM2Args, sd: dict[str, torch.Tensor], take) -> dict[str, torch.Tensor]:
    """Our state dict -> HF names and layouts (lm_head.weight always present); `take(name)` reads sd. A model
    balanced otherwise (no routing biases) writes zeros for them: MiniMaxM2ForCausalLM always routes with one."""
    out = {}
    for ours, hf in hf_sources(args).items():
        if isinstance(hf, str) and not ours.endswith(_BIAS):
            out[hf] = llama.to_hf_tensor(args, ours, take(ours))
    for i in range(args.n_layers):
        ours, theirs = f"layers.{i}.feed_forward.", f"model.layers.{i}.block_sparse_moe."
        tensors = ("router.gate.weight", "experts.w1", "experts.w3", "experts.w2")
        block = moe_to_hf({name: take(ours + name) for name in tensors}, names="w1")
        out |= {theirs + name: t for name, t in block.items()}
        bias = take(ours + _BIAS).float() if args.moe.balance == "bias" else torch.zeros(args.moe.n_experts)
        out[theirs + "e_score_correction_bias"] = bias
    return out
