"""Granite 4.0 H's weights under Hugging Face's names (GraniteMoeHybridForCausalLM), both ways, as its folders store
them (transformers' save_pretrained writes them so again; a folder under transformers' in-memory expert names reads
the same).

Each layer's norms are input_layernorm and post_attention_layernorm (our attention_norm, ffn_norm); its mixer
model.layers.i.mamba or .self_attn. Mamba-2: in_proj's rows are [z | x | B | C | dt] (our wz, wx, wb, wc, wdt),
conv1d's [x | B | C] channels, weight [C, 1, K] (our conv_x, conv_b, conv_c [C, K] and their biases); A_log, D,
dt_bias, the gated norm and out_proj one to one. Attention: q_proj, k_proj, v_proj, o_proj (with rotations, each
head's rotated rows reordered between our adjacent pairs and Hugging Face's halves). Experts: block_sparse_moe's
router.layer [E, dim] (our router.gate), input_linear [E, 2 ffn, dim] the gates' rows then the ups' (w1, w3),
output_linear [E, dim, ffn] (w2); the shared MLP: shared_mlp.input_linear [2 shared, dim] (gate rows, then up) and
output_linear, our MoE's shared_expert, or the feed-forward itself without experts."""

from __future__ import annotations

import re

import torch

from titanlite.models.common import decoder_weights as llama
from titanlite.models.common.mamba2 import CONVOLVED
from titanlite.models.common.mamba2_weights import fused_part, mamba_sources
from titanlite.models.granitemoehybrid.args import GraniteMoeHybridArgs

PREFIX = "model."
ATTENTION = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}
# transformers' in-memory names of the experts (its loading renames the stored ones) -> the stored names
IN_MEMORY = {
    "block_sparse_moe.experts.gate_up_proj": "block_sparse_moe.input_linear.weight",
    "block_sparse_moe.experts.down_proj": "block_sparse_moe.output_linear.weight",
    "block_sparse_moe.router.weight": "block_sparse_moe.router.layer.weight",
}
_EXPERTS = re.compile(r"feed_forward\.experts\.(w1|w3)$")
_SHARED = re.compile(r"feed_forward\.(shared_expert\.)?(w1|w3)\.weight$")


def _attention_sources(args: GraniteMoeHybridArgs, ours: str, hf: str) -> dict[str, str]:
    leaves = ("weight", "bias") if args.qkv_bias else ("weight",)
    return {f"{ours}{o}.{leaf}": f"{hf}{h}.{leaf}" for o, h in ATTENTION.items() for leaf in leaves}


def _feed_forward_sources(args: GraniteMoeHybridArgs, ours: str, hf: str) -> dict[str, str]:
    """The experts and the shared MLP (our MoE's shared expert), or the shared MLP alone (our feed-forward)."""
    shared = f"{ours}shared_expert." if args.moe is not None else ours
    names = {f"{shared}{w}.weight": f"{hf}shared_mlp.input_linear.weight" for w in ("w1", "w3")}
    names[f"{shared}w2.weight"] = f"{hf}shared_mlp.output_linear.weight"
    if args.moe is not None:
        names[f"{ours}router.gate.weight"] = f"{hf}block_sparse_moe.router.layer.weight"
        names |= {f"{ours}experts.{w}": f"{hf}block_sparse_moe.input_linear.weight" for w in ("w1", "w3")}
        names[f"{ours}experts.w2"] = f"{hf}block_sparse_moe.output_linear.weight"
    return names


def hf_sources(args: GraniteMoeHybridArgs) -> dict[str, str]:
    """Our parameter name -> the Hugging Face tensor it is made from (output.weight included even when tied)."""
    names = {
        "tok_embeddings.weight": f"{PREFIX}embed_tokens.weight",
        "norm.weight": f"{PREFIX}norm.weight",
        "output.weight": "lm_head.weight",
    }
    for i, kind in enumerate(args.layer_types):
        ours, hf = f"layers.{i}.", f"{PREFIX}layers.{i}."
        names[f"{ours}attention_norm.weight"] = f"{hf}input_layernorm.weight"
        names[f"{ours}ffn_norm.weight"] = f"{hf}post_attention_layernorm.weight"
        if kind == "mamba":
            names |= mamba_sources(args, f"{ours}attention.", f"{hf}mamba.")
        else:
            names |= _attention_sources(args, f"{ours}attention.", f"{hf}self_attn.")
        names |= _feed_forward_sources(args, f"{ours}feed_forward.", hf)
    return names


def hf_keys(args: GraniteMoeHybridArgs, keys: list[str]) -> dict[str, str]:
    """A folder's tensor names as the stored ones: transformers' in-memory expert names (IN_MEMORY) read as theirs."""
    view = {}
    for key in keys:
        stored = next((key[: -len(m)] + s for m, s in IN_MEMORY.items() if key.endswith(m)), key)
        view[stored] = key
    return view


def _layout(args: GraniteMoeHybridArgs, name: str) -> tuple[int, list[int], int] | None:
    """Where our `name` lies in a fused Hugging Face tensor: the dimension it is cut along, the blocks' widths along
    it and its block (None: a tensor of its own)."""
    if name.startswith("layers.") and args.layer_types[int(name.split(".")[1])] == "mamba":
        part = fused_part(args, name.partition(".attention.")[2])
        if part is not None:  # a Mamba layer's in_proj or conv1d block
            return 0, *part
    experts = _EXPERTS.search(name)
    if experts and args.moe is not None:
        return 1, [args.moe.expert_dim] * 2, ("w1", "w3").index(experts.group(1))
    shared = _SHARED.search(name)
    if shared:
        return 0, [args.ffn_dim] * 2, ("w1", "w3").index(shared.group(2))
    return None


def from_hf_tensor(args: GraniteMoeHybridArgs, name: str, hf: torch.Tensor) -> torch.Tensor:
    """Our parameter `name`'s full value from its Hugging Face tensor (hf_sources[name])."""
    layout = _layout(args, name)
    if layout is None:
        return llama.from_hf_tensor(args, name, hf) if args.rope else hf.contiguous()
    dim, widths, block = layout
    t = hf.split(widths, dim=dim)[block]
    return (t.squeeze(1) if name.endswith(CONVOLVED) else t).contiguous()


def to_hf(args: GraniteMoeHybridArgs, sd: dict[str, torch.Tensor], take) -> dict[str, torch.Tensor]:
    """Our state dict -> Hugging Face's names and layouts (lm_head.weight always present); `take(name)` reads sd."""
    fused: dict[str, list[tuple[int, int, torch.Tensor]]] = {}
    out: dict[str, torch.Tensor] = {}
    for ours, hf in hf_sources(args).items():
        t = take(ours)
        layout = _layout(args, ours)
        if layout is None:
            out[hf] = llama.to_hf_tensor(args, ours, t) if args.rope else t
            continue
        dim, _, block = layout
        fused.setdefault(hf, []).append((block, dim, t.unsqueeze(1) if ours.endswith(CONVOLVED) else t))
    for hf, parts in fused.items():
        ordered = sorted(parts, key=lambda part: part[0])
        out[hf] = torch.cat([t for _, _, t in ordered], dim=ordered[0][1])
    return out
