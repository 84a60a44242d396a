"""The Qwen hybrid decoder (Qwen3.5's text model, which Qwen3.5-MoE and Qwen3-Next share) on the shared decoder
(titanlite/models/common/decoder.py): Gated DeltaNet layers
(titanlite/models/common/gated_delta_net.py) and gated full-attention layers, per-head (1 + w) Q/K norms, partial
rotary, (1 + w) RMSNorms before each sublayer and at the end, a SwiGLU MLP or (Qwen3.5-MoE) a mixture of experts
with a gated shared expert. No parallelism inside."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from titanlite.models.common.decoder import Transformer, grouped_query_attention
from titanlite.models.common.gated_delta_net import gated_delta_net_of
from titanlite.models.common.interface import Decoder
from titanlite.models.common.norms import ZeroCenteredRMSNorm
from titanlite.models.common.qwen_hybrid.args import QwenHybridArgs


def gated_attention(model: Transformer, layer: int) -> nn.Module:
    """The shared attention with (1 + w) per-head Q/K norms, partial rotary (the arguments' rotary_dim) and the
    sigmoid output gate."""
    return grouped_query_attention(model, layer, norm=ZeroCenteredRMSNorm, output_gate=True)


def gated_delta_net(model: QwenHybridDecoder, layer: int) -> nn.Module:
    return gated_delta_net_of(model.args, norm_eps=model.args.norm_eps)


class QwenHybridDecoder(Transformer):
    """Implements titanlite.models.common.interface.Decoder (Qwen3.5, Qwen3.5-MoE, Qwen3-Next)."""

    args: QwenHybridArgs
    mixers = {"full_attention": gated_attention, "linear_attention": gated_delta_net}

    def build_norm(self) -> nn.Module:
        return ZeroCenteredRMSNorm(self.args.dim, eps=self.args.norm_eps)

    def rotary_of(self, layer: int) -> str | None:
        return "rope" if self.layer_kind(layer) == "full_attention" else None


if TYPE_CHECKING:

    def _implements_decoder(model: QwenHybridDecoder) -> Decoder:
        return model
