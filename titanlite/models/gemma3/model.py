"""Gemma 3's text decoder on the shared decoder (titanlite/models/common/decoder.py): (1 + weight) RMSNorms computed
in float32, a norm before and after each sublayer, embeddings scaled by sqrt(dim), a GELU-tanh gated MLP, scores
scaled by query_pre_attn_scalar**-0.5, and two rotary tables (sliding layers rope_local_theta, full layers
rope_theta with linear scaling: Gemma3Args.layer_rope, which the shared decoder builds). No parallelism inside."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from titanlite.models.common.decoder import Transformer, grouped_query_attention
from titanlite.models.common.feed_forward import GatedMLP
from titanlite.models.common.interface import Decoder
from titanlite.models.common.norms import ZeroCenteredRMSNorm
from titanlite.models.gemma3.args import Gemma3Args


def gemma_attention(model: Gemma3, layer: int) -> nn.Module:
    """The shared attention with per-head (1 + weight) Q/K norms and Gemma's score scale."""
    return grouped_query_attention(model, layer, norm=ZeroCenteredRMSNorm, scale=model.args.query_pre_attn_scalar**-0.5)


class Gemma3(Transformer):
    """Implements titanlite.models.common.interface.Decoder."""

    args: Gemma3Args
    mixers = {"full_attention": gemma_attention, "sliding_attention": gemma_attention}

    def __init__(self, args: Gemma3Args):
        super().__init__(args)
        self.embedding_scale = args.dim**0.5

    def build_norm(self) -> nn.Module:
        return ZeroCenteredRMSNorm(self.args.dim, eps=self.args.norm_eps)

    def norm_placement(self, layer: int) -> tuple[str, str]:
        return "both", "both"

    def build_feed_forward(self, layer: int) -> nn.Module:
        return GatedMLP(self.args.dim, self.args.ffn_dim, bias=self.args.mlp_bias, activation="gelu_tanh")


if TYPE_CHECKING:

    def _implements_decoder(model: Gemma3) -> Decoder:
        return model
