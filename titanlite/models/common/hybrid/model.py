"""The hybrid decoder (Qwen3.5's text model, which Qwen3.5-MoE and Qwen3-Next share) on the shared decoder
(titanlite/models/common/decoder.py): Gated DeltaNet layers
(titanlite/models/common/gated_delta_net.py) and gated full-attention layers, per-head (1 + w) Q/K norms, partial
rotary, (1 + w) RMSNorms before each sublayer and at the end, a SwiGLU MLP or (Qwen3.5-MoE) a mixture of experts
with a gated shared expert. No parallelism inside."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from titanlite.models.common.decoder import Transformer, grouped_query_attention, standard_init
from titanlite.models.common.gated_delta_net import GatedDeltaNet
from titanlite.models.common.hybrid.args import HybridArgs
from titanlite.models.common.interface import Decoder
from titanlite.models.common.norms import ZeroCenteredRMSNorm

# (1 + w): start at 0 (enorm, hnorm: multi-token prediction's, models/common/multi_token.py)
ZERO_CENTERED = ("attention_norm", "ffn_norm", "norm", "q_norm", "k_norm", "enorm", "hnorm")
LINEAR_PROJECTIONS = ("wa", "wb", "wz", "wg")  # input-side projections the shared init does not know (and the MoE's
# shared_gate)


def gated_attention(model: Transformer, layer: int) -> nn.Module:
    """The shared attention with (1 + w) per-head Q/K norms, partial rotary (the arguments' rotary_dim) and the
    sigmoid output gate."""
    return grouped_query_attention(model, layer, norm=ZeroCenteredRMSNorm, output_gate=True)


def gated_delta_net(model: HybridDecoder, layer: int) -> nn.Module:
    a = model.args
    return GatedDeltaNet(
        a.dim,
        a.linear_key_heads,
        a.linear_value_heads,
        a.linear_key_dim,
        a.linear_value_dim,
        a.conv_size,
        norm_eps=a.norm_eps,
    )


class HybridDecoder(Transformer):
    """Implements titanlite.models.common.interface.Decoder (Qwen3.5, Qwen3.5-MoE, Qwen3-Next)."""

    args: HybridArgs
    mixers = {"full_attention": gated_attention, "linear_attention": gated_delta_net}

    def build_norm(self) -> nn.Module:
        return ZeroCenteredRMSNorm(self.args.dim, eps=self.args.norm_eps)

    def rotary_of(self, layer: int) -> str | None:
        return "rope" if self.layer_kind(layer) == "full_attention" else None

    def init_param(self, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
        """The shared initialisation, and: the (1 + w) norms at 0, the linear layers' output norms at 1, their
        decays A = exp(A_log) uniform in [0.01, 16] and dt_bias at 1 (transformers' Qwen3.5 init), their convolutions
        uniform in +-1/sqrt(conv_size) (nn.Conv1d's default for a depthwise one), the gate projections as the
        other input-side ones."""
        path, _, leaf = name.rpartition(".")
        parent = path.rpartition(".")[2]
        if leaf == "weight" and path.endswith("attention.norm"):  # a linear layer's output norm: a plain weight
            nn.init.ones_(full)
        elif leaf == "weight" and parent in ZERO_CENTERED:
            nn.init.zeros_(full)
        elif leaf == "A_log":
            full.copy_(torch.empty_like(full).uniform_(0.01, 16.0, generator=generator).log_())
        elif leaf == "dt_bias":
            nn.init.ones_(full)
        elif leaf in ("conv_q", "conv_k", "conv_v"):
            bound = 1.0 / math.sqrt(self.args.conv_size)
            nn.init.uniform_(full, -bound, bound, generator=generator)
        elif leaf == "weight" and parent in LINEAR_PROJECTIONS + ("shared_gate",):
            nn.init.trunc_normal_(full, mean=0.0, std=0.02, a=-0.04, b=0.04, generator=generator)
        else:
            standard_init(self.args, name, full, generator)


if TYPE_CHECKING:

    def _implements_decoder(model: HybridDecoder) -> Decoder:
        return model
