"""Qwen3-Next's weights under Hugging Face's names (Qwen3NextForCausalLM), both ways: Qwen3.5-MoE's
(titanlite/models/common/qwen_hybrid/weights.py) but for the linear layers' input projections, which Qwen3-Next fuses by
key-head group. linear_attn.in_proj_qkvz holds, for each of the linear_key_heads groups in turn, that key head's q
rows, its k rows, then the v rows and then the z rows of the value heads that read it ([Hk, Dk + Dk + r Dv + r Dv, dim],
r = value heads per key head); in_proj_ba likewise each group's b rows then its a rows ([Hk, r + r, dim]). Import
regroups them into our wq, wk, wv, wz, wb, wa (value heads in the order g r + j, as transformers' reshape leaves them);
export fuses them back. conv1d.weight is [q | k | v] of the regrouped heads, as Qwen3.5's. The multi-token prediction
layer of the published folders (mtp.*) is read as Qwen3.5's (titanlite/models/common/qwen_hybrid/weights.py), or, with
mtp_layers 0, carried (hf_carried), unchanged into an export."""

from __future__ import annotations

import torch

from titanlite.models.common.decoder_args import kind_of
from titanlite.models.common.qwen_hybrid import weights as hybrid
from titanlite.models.qwen3_next.args import Qwen3NextArgs

FUSED = {  # Hugging Face's fused tensor (under linear_attn.) -> ours (under attention.), in its per-group row order
    "in_proj_qkvz.weight": ("wq.weight", "wk.weight", "wv.weight", "wz.weight"),
    "in_proj_ba.weight": ("wb.weight", "wa.weight"),
}
PART = {ours: (hf, i) for hf, parts in FUSED.items() for i, ours in enumerate(parts)}
MTP_PREFIX = "mtp."


def hf_carried(args: Qwen3NextArgs, keys: list[str]) -> list[str]:
    """The multi-token-prediction layer's tensors (mtp.*) where the model has none (mtp_layers 0): not trained,
    carried unchanged into an export."""
    return [] if args.mtp_layers else [k for k in keys if k.startswith(MTP_PREFIX)]


def _linear_layer(args: Qwen3NextArgs, name: str) -> bool:
    return name.startswith("layers.") and kind_of(args, int(name.split(".")[1])) == "linear_attention"


def hf_sources(args: Qwen3NextArgs) -> dict[str, str | tuple[str, ...]]:
    """Our parameter name -> the Hugging Face tensor(s) it is made from."""
    sources = hybrid.hf_sources(args)
    for ours in sources:
        leaf = ours.split(".attention.")[-1]
        if leaf in PART and _linear_layer(args, ours):
            sources[ours] = f"model.layers.{ours.split('.')[1]}.linear_attn.{PART[leaf][0]}"
    return sources


def hf_keys(args: Qwen3NextArgs, keys: list[str]) -> dict[str, str]:
    """A folder's tensor names as they are (the carried mtp.*, if any, are left out before this is asked)."""
    return {k: k for k in keys}


def _widths(args: Qwen3NextArgs, fused: str) -> list[int]:
    """Rows of each part in one key-head group of a fused tensor."""
    per_key = args.linear_value_heads // args.linear_key_heads
    if fused == "in_proj_ba.weight":
        return [per_key, per_key]
    value = per_key * args.linear_value_dim
    return [args.linear_key_dim, args.linear_key_dim, value, value]


def ungroup(args: Qwen3NextArgs, fused: str, w: torch.Tensor, part: int) -> torch.Tensor:
    """Part `part` of fused tensor `fused` [Hk * group rows, dim], its groups' rows in head order."""
    groups = w.view(args.linear_key_heads, -1, w.shape[-1]).split(_widths(args, fused), dim=1)
    return groups[part].reshape(-1, w.shape[-1]).contiguous()


def group(args: Qwen3NextArgs, parts: list[torch.Tensor]) -> torch.Tensor:
    """The fused tensor of `parts` (ours, in FUSED's order): each key-head group's rows of every part in turn."""
    grouped = [p.view(args.linear_key_heads, -1, p.shape[-1]) for p in parts]
    return torch.cat(grouped, dim=1).reshape(-1, parts[0].shape[-1])


def from_hf_tensor(args: Qwen3NextArgs, name: str, hf: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """Our parameter `name`'s full value from its Hugging Face tensor(s) (hf_sources[name])."""
    leaf = name.split(".attention.")[-1]
    if leaf in PART and isinstance(hf, torch.Tensor) and _linear_layer(args, name):
        fused, part = PART[leaf]
        return ungroup(args, fused, hf, part)
    return hybrid.from_hf_tensor(args, name, hf)


def to_hf(args: Qwen3NextArgs, sd: dict[str, torch.Tensor], take) -> dict[str, torch.Tensor]:
    """Our state dict -> Qwen3NextForCausalLM's names and layouts (lm_head.weight always present): Qwen3.5-MoE's,
    the linear layers' separate projections replaced by the fused ones."""
    out = hybrid.to_hf(args, sd, take)
    for i, kind in enumerate(args.layer_types):
        if kind != "linear_attention":
            continue
        ours, hf = f"layers.{i}.attention.", f"model.layers.{i}.linear_attn."
        for separate in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
            del out[f"{hf}{separate}.weight"]
        for fused, parts in FUSED.items():
            out[hf + fused] = group(args, [take(ours + p) for p in parts])
    return out
