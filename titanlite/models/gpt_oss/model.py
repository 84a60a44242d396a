"""gpt-oss (GptOssForCausalLM): the MoE decoder (titanlite/models/moe_decoder/model.py) with attention sinks, q/k/v/o
biases, sliding and full layers by layer_types, YaRN rotations, a router with a bias (top-k of the logits, softmax
over the k: the shared Router's softmax then renormalised top-k, the same numbers) and experts with biases and the
clamped SwiGLU (titanlite/models/common/moe.py ClampedSwiGLU). No parallelism inside."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from titanlite.models.common.attention import build_core, local_sinks
from titanlite.models.common.interface import Decoder
from titanlite.models.common.moe import ClampedSwiGLU, GroupedExperts, MoE
from titanlite.models.gpt_oss.args import GptOssArgs
from titanlite.models.llama3 import model as llama
from titanlite.models.llama3.args import window_of
from titanlite.models.moe_decoder.model import MoEDecoder


class Attention(llama.Attention):
    """Llama's grouped-query attention with one learned sink logit per query head (`sinks` [n_heads]), which the
    core adds to each query's softmax denominator (titanlite/models/common/attention.py)."""

    def __init__(self, args: GptOssArgs, window: int | None):
        super().__init__(args, window=window)
        self.sinks = nn.Parameter(torch.empty(args.n_heads))
        self.core = build_core("sdpa", window=window, sinks=True)

    def attention_sinks(self) -> torch.Tensor:
        return local_sinks(self.sinks)


class GptOss(MoEDecoder):
    """Implements titanlite.models.common.interface.Decoder: the MoE decoder's blocks with gpt-oss's attention and
    experts (built on the meta device by the builder, where replacing the decoder's costs nothing)."""

    args: GptOssArgs

    def __init__(self, args: GptOssArgs):
        super().__init__(args)
        activation = ClampedSwiGLU(alpha=args.swiglu_alpha, limit=args.swiglu_limit)
        for i, block in self.layers.items():
            block.attention = Attention(args, window_of(args, int(i)))
            moe = block.feed_forward
            if isinstance(moe, MoE):
                experts = GroupedExperts(
                    args.dim, args.moe.expert_dim, args.moe.n_experts, bias=True, activation=activation
                )
                moe.experts = experts

    def init_param(self, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
        """The MoE decoder's initialisation; the sinks as transformers' (normal, std 0.02), the experts' biases zero."""
        path, _, leaf = name.rpartition(".")
        if leaf == "sinks":
            nn.init.normal_(full, mean=0.0, std=0.02, generator=generator)
        elif path.endswith("experts") and leaf in ("b1", "b3", "b2"):
            nn.init.zeros_(full)
        else:
            super().init_param(name, full, generator)


if TYPE_CHECKING:  # mypy (.ci/run) holds the class to the model interface and names any member that differs

    def _implements_decoder(model: GptOss) -> Decoder:
        return model
