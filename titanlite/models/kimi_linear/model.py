"""Kimi Linear on the shared latent-attention decoder (titanlite/models/common/latent/model.py): pre-norm blocks whose
mixer is Kimi Delta Attention (titanlite/models/common/kimi_delta.py) or multi-head latent attention without rotary
positions (titanlite/models/common/mixers.py LatentAttention, rotary=False), as args.layer_types says, and whose
feed-forward is the shared mixture of experts (sigmoid scores, the balancing bias, shared experts, each block its own
load-balancing term) or, at moe.dense_layers, a dense SwiGLU. No layer reads a rotary table. Plain modules with no
parallelism inside."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from titanlite.models.common.interface import Decoder
from titanlite.models.common.kimi_delta import KimiDeltaAttention
from titanlite.models.common.latent.model import LatentDecoder, latent_attention
from titanlite.models.kimi_linear.args import KimiLinearArgs


def kimi_delta_attention(model: KimiLinear, layer: int) -> nn.Module:
    a = model.args
    return KimiDeltaAttention(a.dim, a.linear_heads, a.linear_head_dim, a.conv_size, norm_eps=a.norm_eps)


class KimiLinear(LatentDecoder):
    """Implements titanlite.models.common.interface.Decoder."""

    args: KimiLinearArgs
    mixers = {"full_attention": latent_attention, "linear_attention": kimi_delta_attention}
    pooled_balance = False  # each MoE block adds its own term (transformers' KimiLinear has no pooled one)


if TYPE_CHECKING:  # mypy holds the class to the model interface and names any member that differs

    def _implements_decoder(model: KimiLinear) -> Decoder:
        return model
