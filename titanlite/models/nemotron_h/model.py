"""Nemotron-H on the shared decoder (titanlite/models/common/decoder.py): every layer one sublayer behind its own
RMSNorm, as args.layer_types says: a Mamba-2 mixer (titanlite/models/common/mamba2.py) or attention without positions
(MixerBlock), or a relu^2 MLP or the shared mixture of experts (FeedForwardBlock); a multi-token prediction depth's
block is attention then the mixture of experts (Block). No layer reads a rotary table.
Plain modules with no parallelism inside."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from titanlite.models.common.decoder import Block, FeedForwardBlock, MixerBlock, Transformer, grouped_query_attention
from titanlite.models.common.feed_forward import MLP
from titanlite.models.common.interface import Decoder
from titanlite.models.common.mamba2 import mamba2_of
from titanlite.models.common.rope import RotaryTable
from titanlite.models.nemotron_h.args import NemotronHArgs


def mamba2(model: NemotronH, layer: int) -> nn.Module:
    return mamba2_of(model.args)


def attention(model: NemotronH, layer: int) -> nn.Module:
    return grouped_query_attention(model, layer, rotary=False)


class NemotronH(Transformer):
    """Implements titanlite.models.common.interface.Decoder (Nemotron-H)."""

    args: NemotronHArgs
    mixers = {"mamba": mamba2, "full_attention": attention}
    pooled_balance = False  # transformers' Nemotron-H has no load-balancing term to pool: its experts balance by bias

    def build_layer(self, layer: int) -> nn.Module:
        if layer >= self.args.n_layers:  # a multi-token prediction depth: attention, then the mixture of experts
            return Block(attention(self, layer), self.build_feed_forward(layer), self.build_norm, rotary=False)
        kind = self.layer_kind(layer)
        if kind == "moe":  # the shared decoder's mixture of experts (args.moe: relu^2 experts, maybe latent)
            return FeedForwardBlock(self.build_feed_forward(layer), self.build_norm)
        if kind == "mlp":
            mlp = MLP(self.args.dim, self.args.ffn_dim, activation="relu2", bias=self.args.mlp_bias)
            return FeedForwardBlock(mlp, self.build_norm)
        return MixerBlock(self.build_mixer(layer), self.build_norm, rotary=False)

    def rotary_tables(self) -> dict[str, RotaryTable]:
        return {}


if TYPE_CHECKING:

    def _implements_decoder(model: NemotronH) -> Decoder:
        return model
