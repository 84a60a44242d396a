"""Falcon-H1 on the shared decoder (titanlite/models/common/decoder.py): every layer a ParallelBlock, grouped-query
attention with RoPE and a Mamba-2 mixer (titanlite/models/common/mamba2.py) side by side on one normed input, then a
SwiGLU MLP; with the muP multipliers of its arguments on the embeddings, each mixer's input and output, the keys, the
Mamba projections, the MLP's gate and output, and the logits. Plain modules with no parallelism inside: every
multiplier is applied outside the linear layers, so float8 and tensor parallelism, which replace or shard those,
keep them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from titanlite.models.common.decoder import ParallelBlock, Transformer, grouped_query_attention
from titanlite.models.common.feed_forward import GatedMLP
from titanlite.models.common.interface import Decoder
from titanlite.models.common.mamba2 import mamba2_of
from titanlite.models.common.norms import ScaledRMSNorm
from titanlite.models.falcon_h1.args import FalconH1Args


class FalconH1MLP(GatedMLP):
    """Falcon-H1's SwiGLU: w2(silu(w1(x) * gate) * w3(x)) * down, `multipliers` = (gate, down) (mlp_multipliers)."""

    def __init__(self, dim: int, hidden_dim: int, multipliers: tuple[float, float], bias: bool = False):
        super().__init__(dim, hidden_dim, bias=bias)
        self.gate_multiplier, self.down_multiplier = multipliers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x) * self.gate_multiplier) * self.w3(x)) * self.down_multiplier


def attention(model: FalconH1, layer: int) -> nn.Module:
    """The layer's attention: the keys times key_multiplier as the scores' scale (q . (m k) / sqrt(d) is the same
    product, and RoPE, a rotation, commutes with it)."""
    a = model.args
    scale = None if a.key_multiplier == 1.0 else a.key_multiplier * a.head_dim**-0.5
    return grouped_query_attention(model, layer, scale=scale)


def mamba2(model: FalconH1, layer: int) -> nn.Module:
    a = model.args
    return mamba2_of(
        a,
        out_bias=a.mamba_out_bias,
        norm_before_gate=a.mamba_norm_before_gate,
        gated_norm=a.mamba_gated_norm,
        multipliers=a.ssm_multipliers,
    )


class FalconH1(Transformer):
    """Implements titanlite.models.common.interface.Decoder (Falcon-H1)."""

    args: FalconH1Args
    mixers = {"full_attention": attention}

    def __init__(self, args: FalconH1Args):
        super().__init__(args)
        self.embedding_multiplier = args.embedding_multiplier
        # The final norm, as built (at the same place among the modules), with the logits' multiplier.
        self.norm = ScaledRMSNorm(args.dim, args.norm_eps, args.lm_head_multiplier)

    def build_layer(self, layer: int) -> nn.Module:
        a = self.args
        return ParallelBlock(
            self.build_mixer(layer),
            mamba2(self, layer),
            FalconH1MLP(a.dim, a.ffn_dim, a.mlp_multipliers, bias=a.mlp_bias),
            self.build_norm,
            multipliers=(
                a.attention_in_multiplier,
                a.attention_out_multiplier,
                a.ssm_in_multiplier,
                a.ssm_out_multiplier,
            ),  # fmt: skip
        )


if TYPE_CHECKING:

    def _implements_decoder(model: FalconH1) -> Decoder:
        return model
