"""MiniMax-M2's module: the shared decoder (titanlite/models/common/decoder.py) whose attention normalises each token's
whole query and key projection and rotates the leading rotary_dim channels of each head, with a mixture of
sigmoid-routed experts on every layer (its arguments say so: MiniMaxM2Args). No parallelism inside."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from titanlite.models.common.decoder import Transformer, grouped_query_attention
from titanlite.models.common.interface import Decoder
from titanlite.models.common.rope import RotaryTable
from titanlite.models.minimax_m2.args import MiniMaxM2Args


def partial_rotary_attention(model: Transformer, layer: int) -> nn.Module:
    """The shared attention (whole-projection Q/K norms from the arguments) rotating rotary_dim channels a head."""
    return grouped_query_attention(model, layer, rotary_dim=model.args.rotary_dim)


class MiniMaxM2(Transformer):
    """Implements titanlite.models.common.interface.Decoder for MiniMax-M2."""

    args: MiniMaxM2Args
    mixers = {"full_attention": partial_rotary_attention, "sliding_attention": partial_rotary_attention}

    def rotary_tables(self) -> dict[str, RotaryTable]:
        """One table over the rotating channels: frequencies theta^(-2i / rotary_dim), as transformers' partial
        rotary computes them."""
        a = self.args
        return {"rope": RotaryTable(a.rotary_dim, a.rope_theta, a.rope_scaling)}


if TYPE_CHECKING:  # mypy holds the class to the model interface

    def _implements_decoder(model: MiniMaxM2) -> Decoder:
        return model
