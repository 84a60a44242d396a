"""Qwen3-MoE's weights under Hugging Face's names: the Llama decoder's (titanlite/models/llama3/weights.py), and at
each sparse layer the router (model.layers.N.mlp.gate.weight) and one tensor per expert
(model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight), stacked into our experts.w1, w3 and w2 on import."""

from __future__ import annotations

import torch

from titanlite.models.common.moe import EXPERT_NAMES, moe_to_hf
from titanlite.models.llama3 import weights as llama
from titanlite.models.qwen3_moe.args import Qwen3MoeArgs

_STACKED = dict(zip(("w1", "w3", "w2"), EXPERT_NAMES["gate_proj"]))  # ours -> HF per-expert projection


def hf_sources(args: Qwen3MoeArgs) -> dict[str, str | tuple[str, ...]]:
    """Our parameter name -> the HF tensor it is made from; a stacked expert tensor -> its experts' tensors."""
    names: dict[str, str | tuple[str, ...]] = {}
    for ours, hf in llama.hf_names(args).items():
        layer = ours.split(".")[1] if ours.startswith("layers.") else ""
        if not (layer and ".feed_forward." in ours and args.moe.is_sparse(int(layer))):
            names[ours] = hf
    for i in range(args.n_layers):
        if args.moe.is_sparse(i):
            ours, hf = f"layers.{i}.feed_forward.", f"model.layers.{i}.mlp."
            names[ours + "router.gate.weight"] = hf + "gate.weight"
            for w, proj in _STACKED.items():
                names[ours + f"experts.{w}"] = tuple(
                    f"{hf}experts.{e}.{proj}.weight" for e in range(args.moe.n_experts)
                )
    return names


def hf_keys(args: Qwen3MoeArgs, keys: list[str]) -> dict[str, str]:
    return {k: k for k in keys}


def to_hf(args: Qwen3MoeArgs, sd: dict[str, torch.Tensor], take) -> dict[str, torch.Tensor]:
    """Our state dict -> HF names and layouts (lm_head.weight always present); `take(name)` reads sd."""
    out = {}
    for ours, hf in hf_sources(args).items():
        if isinstance(hf, str):
            heads = llama.rope_heads(args, ours)
            out[hf] = take(ours) if heads is None else llama.rope_to_hf(take(ours), heads)
    for i in range(args.n_layers):
        if args.moe.is_sparse(i):
            ours = f"layers.{i}.feed_forward."
            block = {
                name: take(ours + name) for name in ("router.gate.weight", "experts.w1", "experts.w3", "experts.w2")
            }
            out |= {f"model.layers.{i}.mlp.{name}": t for name, t in moe_to_hf(block).items()}
    return out


def from_hf_tensor(args: Qwen3MoeArgs, name: str, hf: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """Our parameter `name`'s full value from its HF tensor, or from its experts' tensors (hf_sources[name])."""
    if isinstance(hf, list):  # one stacked expert tensor, from its experts' tensors in expert order
        # (the loader reads one parameter's tensors at a time; moe_from_hf maps a whole block's at once)
        return torch.stack(hf).contiguous()
    return llama.from_hf_tensor(args, name, hf)
