"""A Mamba-2 mixer's Hugging Face tensors both ways, as every family on it stores them (Nemotron-H, Granite 4.0 H,
Falcon-H1: transformers' Mamba-2 layout): in_proj's rows are [z | x | B | C | dt] (our wz, wx, wb, wc, wdt, and their
biases), conv1d's channels [x | B | C], weight [C, 1, K] (our conv_x, conv_b, conv_c [C, K]) and bias (their
biases); A_log, D, dt_bias, the gated norm and out_proj one to one. A family maps its layers' prefixes; this module
the mixer's tensors under them."""

from __future__ import annotations

import torch

from titanlite.models.common.mamba2 import CONVOLVED, CONVOLVED_BIASES
from titanlite.models.common.mamba2_args import Mamba2Args

IN_PROJ = ("wz", "wx", "wb", "wc", "wdt")  # in_proj's row blocks, in order


def mamba_sources(
    args: Mamba2Args, ours: str, hf: str, out_bias: bool | None = None, gated_norm: bool = True
) -> dict[str, str]:
    """The mixer's parameters under `ours` (e.g. "layers.0.attention.") -> the Hugging Face tensors under `hf` (e.g.
    "backbone.layers.0.mixer."): the projections' biases where args.mamba_bias (out_proj's where `out_bias`, or
    mamba_bias when None), the convolution's where args.conv_bias, the norm's weight where `gated_norm`."""
    out_bias = args.mamba_bias if out_bias is None else out_bias
    names = {f"{ours}{w}.weight": f"{hf}in_proj.weight" for w in IN_PROJ}
    if args.mamba_bias:
        names |= {f"{ours}{w}.bias": f"{hf}in_proj.bias" for w in IN_PROJ}
    names |= {f"{ours}{w}": f"{hf}conv1d.weight" for w in CONVOLVED}
    if args.conv_bias:
        names |= {f"{ours}{w}": f"{hf}conv1d.bias" for w in CONVOLVED_BIASES}
    names |= {f"{ours}{w}": f"{hf}{w}" for w in ("A_log", "D", "dt_bias")}
    if gated_norm:
        names[f"{ours}norm.weight"] = f"{hf}norm.weight"
    names[f"{ours}wo.weight"] = f"{hf}out_proj.weight"
    if out_bias:
        names[f"{ours}wo.bias"] = f"{hf}out_proj.bias"
    return names


def fused_part(args: Mamba2Args, leaf: str) -> tuple[list[int], int] | None:
    """Where the mixer's parameter `leaf` ("wz.weight", "conv_b", "conv_c_bias", ...) lies in a fused Hugging Face
    tensor: the row widths of in_proj or conv1d and its block; None for a tensor of its own."""
    bc = args.mamba_groups * args.state_dim
    base = leaf.partition(".")[0]
    if base in IN_PROJ:
        return [args.mamba_width, args.mamba_width, bc, bc, args.mamba_heads], IN_PROJ.index(base)
    if leaf in CONVOLVED:
        return [args.mamba_width, bc, bc], CONVOLVED.index(leaf)
    if leaf in CONVOLVED_BIASES:
        return [args.mamba_width, bc, bc], CONVOLVED_BIASES.index(leaf)
    return None


def from_fused(args: Mamba2Args, leaf: str, hf: torch.Tensor) -> torch.Tensor | None:
    """The mixer's parameter `leaf` from its fused Hugging Face tensor (a convolution's weight [C, 1, K] as our
    [C, K]); None where `leaf` is a tensor of its own."""
    part = fused_part(args, leaf)
    if part is None:
        return None
    t = hf.split(part[0], dim=0)[part[1]]
    return (t.squeeze(1) if leaf in CONVOLVED else t).contiguous()


class Fusing:
    """The fused Hugging Face tensors of an export, gathered part by part (add) and joined in order (tensors)."""

    def __init__(self) -> None:
        self.parts: dict[str, list[tuple[int, torch.Tensor]]] = {}

    def add(self, args: Mamba2Args, leaf: str, hf: str, t: torch.Tensor) -> bool:
        """Keep our tensor `t` (the mixer's parameter `leaf`) as its block of `hf`; False where `leaf` is a tensor of
        its own (nothing kept)."""
        part = fused_part(args, leaf)
        if part is None:
            return False
        self.parts.setdefault(hf, []).append((part[1], t.unsqueeze(1) if leaf in CONVOLVED else t))
        return True

    def tensors(self) -> dict[str, torch.Tensor]:
        return {hf: torch.cat([t for _, t in sorted(parts, key=lambda p: p[0])]) for hf, parts in self.parts.items()}
