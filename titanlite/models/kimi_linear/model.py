"""Kimi Linear on the shared latent-attention decoder (titanlite/models/common/latent/model.py): pre-norm blocks whose
mixer is Kimi Delta Attention (titanlite/models/common/kimi_delta.py) or multi-head latent attention without rotary
positions (titanlite/models/common/mixers.py LatentAttention, rotary=False), as args.layer_types says, and whose
feed-forward is the shared mixture of experts (sigmoid scores, the balancing bias, shared experts, each block its own
load-balancing term) or, at moe.dense_layers, a dense SwiGLU. No layer reads a rotary table. Plain modules with no
parallelism inside."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
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
    own_projections = ("wk", "wv", "wf_a", "wf_b", "wb", "wg_a", "wg_b")  # KDA's (its wq, wo and norm are shared names)

    def init_param(self, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
        """Fill `full` (parameter `name`'s full value) using only `generator`: DeepSeek-V3's scheme
        (LatentDecoder.init_param) but for KDA's own: its convolutions as nn.Conv1d's (uniform within 1/sqrt(K)),
        A_log the log of uniform(1, 16) and dt_bias the inverse softplus of exp(uniform(log 1e-3, log 1e-1))
        (flash-linear-attention's and transformers' initialisation)."""
        leaf = name.rpartition(".")[2]
        if leaf in ("conv_q", "conv_k", "conv_v"):
            bound = 1 / math.sqrt(full.shape[1])
            nn.init.uniform_(full, -bound, bound, generator=generator)
        elif leaf == "A_log":
            full.copy_(torch.empty_like(full).uniform_(1.0, 16.0, generator=generator).log())
        elif leaf == "dt_bias":
            dt = torch.empty_like(full).uniform_(math.log(1e-3), math.log(1e-1), generator=generator).exp()
            dt = dt.clamp_min(1e-4)
            full.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
        else:
            super().init_param(name, full, generator)


if TYPE_CHECKING:  # mypy holds the class to the model interface and names any member that differs

    def _implements_decoder(model: KimiLinear) -> Decoder:
        return model
