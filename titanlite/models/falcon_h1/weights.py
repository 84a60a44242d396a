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
from titanlite.models.common.mamba2 import CONVOLVED, CONVOLVED_BIASES
from titanlite.models.falcon_h1.args import FalconH1Args

IN_PROJ = ("wz", "wx", "wb", "wc", "wdt")  # in_proj's row blocks, in order
ATTENTION = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}
MLP = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _in_proj_widths(args: FalconH1Args) -> list[int]:
    bc = args.mamba_groups * args.state_dim
    return [args.mamba_width, args.mamba_width, bc, bc, args.mamba_heads]


def _conv_widths(args: FalconH1Args) -> list[int]:
    bc = args.mamba_groups * args.state_dim
    return [args.mamba_width, bc, bc]


def _leaves(bias: bool) -> tuple[str, ...]:
    return ("weight", "bias") if bias else ("weight",)


def _mamba_sources(args: FalconH1Args, ours: str, hf: str) -> dict[str, str]:
    names = {f"{ours}{w}.{leaf}": f"{hf}in_proj.{leaf}" for w in IN_PROJ for leaf in _leaves(args.mamba_bias)}
    names |= {f"{ours}{w}": f"{hf}conv1d.weight" for w in CONVOLVED}
    if args.conv_bias:
        names |= {f"{ours}{w}": f"{hf}conv1d.bias" for w in CONVOLVED_BIASES}
    names |= {f"{ours}{w}": f"{hf}{w}" for w in ("A_log", "D", "dt_bias")}
    if args.mamba_gated_norm:
        names[f"{ours}norm.weight"] = f"{hf}norm.weight"
    names |= {f"{ours}wo.{leaf}": f"{hf}out_proj.{leaf}" for leaf in _leaves(args.mamba_out_bias)}
    return names


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
        names |= _mamba_sources(args, f"{ours}mamba.", f"{hf}mamba.")
    return names


def hf_keys(args: FalconH1Args, keys: list[str]) -> dict[str, str]:
    """A folder's tensor names as the stored ones: the same (transformers saves Falcon-H1 under its module names)."""
    return {k: k for k in keys}


def _part(args: FalconH1Args, name: str) -> tuple[list[int], int] | None:
    """Where our `name` lies in a fused Hugging Face tensor: the row widths and its block (None: a tensor alone)."""
    if ".mamba." not in name:
        return None
    leaf = name.rpartition(".mamba.")[2]
    base = leaf.partition(".")[0]
    if base in IN_PROJ:
        return _in_proj_widths(args), IN_PROJ.index(base)
    if leaf in CONVOLVED:
        return _conv_widths(args), CONVOLVED.index(leaf)
    if leaf in CONVOLVED_BIASES:
        return _conv_widths(args), CONVOLVED_BIASES.index(leaf)
    return None


def from_hf_tensor(args: FalconH1Args, name: str, hf: torch.Tensor) -> torch.Tensor:
    """Our parameter `name`'s full value from its Hugging Face tensor (hf_sources[name])."""
    part = _part(args, name)
    if part is None:
        return decoder_weights.from_hf_tensor(args, name, hf).contiguous()
    widths, block = part
    t = hf.split(widths, dim=0)[block]
    return (t.squeeze(1) if t.dim() == 3 else t).contiguous()


def to_hf(args: FalconH1Args, sd: dict[str, torch.Tensor], take) -> dict[str, torch.Tensor]:
    """Our state dict -> Hugging Face's names and layouts (lm_head.weight always present); `take(name)` reads sd."""
    fused: dict[str, list[tuple[int, torch.Tensor]]] = {}
    out: dict[str, torch.Tensor] = {}
    for ours, hf in hf_sources(args).items():
        part = _part(args, ours)
        if part is None:
            out[hf] = decoder_weights.to_hf_tensor(args, ours, take(ours))
            continue
        t = take(ours)
        fused.setdefault(hf, []).append((part[1], t.unsqueeze(1) if ours.endswith(CONVOLVED) else t))
    for hf, parts in fused.items():
        out[hf] = torch.cat([t for _, t in sorted(parts, key=lambda p: p[0])])
    return out
