"""Granite 4.0 H on the shared decoder (titanlite/models/common/decoder.py): every layer a mixer, Mamba-2
(titanlite/models/common/mamba2.py) or grouped-query attention (scores scaled by attention_multiplier, rotated only
where args.rope), then the shared mixture of experts (titanlite/models/common/moe/) whose shared expert is Granite's
shared MLP, or that SwiGLU MLP alone; each behind its own RMSNorm, its output times residual_multiplier before the
residual add (GraniteBlock). The embeddings are multiplied by embedding_multiplier, and the final norm's output by
1 / logits_scaling (ScaledRMSNorm), which divides the logits however the head is applied (the chunked loss applies
it itself). Plain
modules with no parallelism inside."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from titanlite.models.common.attention import Sequence
from titanlite.models.common.decoder import Block, Transformer, grouped_query_attention
from titanlite.models.common.interface import Decoder
from titanlite.models.common.kv_cache import LayerCache
from titanlite.models.common.mamba2 import mamba2_of
from titanlite.models.common.norms import ScaledRMSNorm
from titanlite.models.common.rope import RotaryTable
from titanlite.models.granitemoehybrid.args import GraniteMoeHybridArgs


class GraniteBlock(Block):
    """One Granite layer: x + s * mixer(norm(x)), then h + s * feed_forward(norm(h)), s the residual multiplier.
    Block's modules under Block's names (attention_norm, attention, ffn_norm, feed_forward), so the shared plans and
    weight names apply."""

    def __init__(
        self,
        mixer: nn.Module,
        feed_forward: nn.Module,
        norm: Callable[[], nn.Module],
        residual_scale: float,
        rotary: bool,
    ):
        super().__init__(mixer, feed_forward, norm, "pre", "pre", rotary=rotary)
        self.residual_scale = residual_scale

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None = None,
        sin: torch.Tensor | None = None,
        cache: LayerCache | None = None,
        sequence: Sequence | None = None,
    ) -> torch.Tensor:
        rope = (cos, sin) if self.rotary else ()
        h = x + self.attention(self.attention_norm(x), *rope, cache=cache, sequence=sequence) * self.residual_scale
        return h + self.feed_forward(self.ffn_norm(h)) * self.residual_scale


def mamba2(model: GraniteMoeHybrid, layer: int) -> nn.Module:
    return mamba2_of(model.args)


def attention(model: GraniteMoeHybrid, layer: int) -> nn.Module:
    a = model.args
    return grouped_query_attention(model, layer, scale=a.attention_multiplier, rotary=a.rope)


class GraniteMoeHybrid(Transformer):
    """Implements titanlite.models.common.interface.Decoder (Granite 4.0 H)."""

    args: GraniteMoeHybridArgs
    mixers = {"mamba": mamba2, "full_attention": attention}

    def __init__(self, args: GraniteMoeHybridArgs):
        super().__init__(args)
        self.embedding_multiplier = args.embedding_multiplier
        self.norm = ScaledRMSNorm(args.dim, args.norm_eps, 1.0 / args.logits_scaling)  # the logits divided

    def build_layer(self, layer: int) -> nn.Module:
        """A GraniteBlock of the layer's mixer and the shared decoder's feed-forward: the mixture of experts with
        the shared MLP as its shared expert (args.moe), or the SwiGLU MLP of ffn_dim alone."""
        return GraniteBlock(
            self.build_mixer(layer),
            self.build_feed_forward(layer),
            self.build_norm,
            self.args.residual_multiplier,
            rotary=self.layer_rotary[str(layer)] is not None,
        )

    def rotary_tables(self) -> dict[str, RotaryTable]:
        return super().rotary_tables() if self.args.rope else {}

    def rotary_of(self, layer: int) -> str | None:
        return "rope" if self.args.rope and self.layer_kind(layer) == "full_attention" else None


if TYPE_CHECKING:

    def _implements_decoder(model: GraniteMoeHybrid) -> Decoder:
        return model
