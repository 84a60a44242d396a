"""gpt-oss (GptOssForCausalLM) on the shared decoder (titanlite/models/common/decoder.py): attention sinks, q/k/v/o
biases, sliding and full layers by layer_types, YaRN rotations, a router with a bias (top-k of the logits, softmax
over the k: the shared Router's softmax then renormalised top-k, the same numbers), experts with biases and the
clamped SwiGLU (titanlite/models/common/moe/layer.py ClampedSwiGLU), the pooled load-balancing term. No parallelism
inside."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from titanlite.models.common.decoder import Transformer, grouped_query_attention
from titanlite.models.common.interface import Decoder
from titanlite.models.common.moe.layer import ClampedSwiGLU, GroupedExperts
from titanlite.models.gpt_oss.args import GptOssArgs


def sink_attention(model: Transformer, layer: int) -> nn.Module:
    """The shared attention with one learned sink logit per query head (`sinks` [n_heads]), which the core adds to
    each query's softmax denominator (titanlite/models/common/attention.py)."""
    return grouped_query_attention(model, layer, sinks=True)


class GptOss(Transformer):
    """Implements titanlite.models.common.interface.Decoder."""

    args: GptOssArgs
    mixers = {"full_attention": sink_attention, "sliding_attention": sink_attention}

    def build_experts(self) -> GroupedExperts:
        a = self.args
        activation = ClampedSwiGLU(alpha=a.swiglu_alpha, limit=a.swiglu_limit)
        return GroupedExperts(a.dim, a.moe.expert_dim, a.moe.n_experts, bias=True, activation=activation)


if TYPE_CHECKING:  # mypy (.ci/run) holds the class to the model interface and names any member that differs

    def _implements_decoder(model: GptOss) -> Decoder:
        return model
