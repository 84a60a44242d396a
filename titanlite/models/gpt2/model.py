"""GPT-2 on the shared decoder (titanlite/models/common/decoder.py): learned positions, pre-LayerNorm blocks,
attention with biases and no rotations, a GELU MLP, tied embeddings, no dropout.
Plain modules with no parallelism inside; the trainer shards them from outside."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from titanlite.models.common.decoder import Transformer
from titanlite.models.common.feed_forward import MLP
from titanlite.models.common.interface import Decoder
from titanlite.models.common.mixers import Attention
from titanlite.models.common.rope import RotaryTable
from titanlite.models.gpt2.args import GPT2Args


def gpt2_attention(model: GPT2, layer: int) -> nn.Module:
    a = model.args
    return Attention(a.dim, a.n_heads, a.n_heads, a.head_dim, qkv_bias=True, out_bias=True, rotary=False)


class GPT2(Transformer):
    """Implements titanlite.models.common.interface.Decoder."""

    args: GPT2Args
    first_stage_modules: ClassVar[tuple[str, ...]] = ("tok_embeddings", "pos_embeddings")
    learned_positions = True
    mixers = {"full_attention": gpt2_attention}

    def build_norm(self) -> nn.Module:
        return nn.LayerNorm(self.args.dim, eps=self.args.norm_eps)

    def build_feed_forward(self, layer: int) -> nn.Module:
        return MLP(self.args.dim, self.args.ffn_dim, self.args.activation)

    def rotary_tables(self) -> dict[str, RotaryTable]:
        return {}  # learned positions instead

    def init_param(self, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
        """Fill `full` (the full-size value of parameter `name`) in place, using only `generator`."""
        # Match on the last two name components, so wrapper prefixes (e.g. "_orig_mod.") do not matter.
        path, _, leaf = name.rpartition(".")
        parent = path.rpartition(".")[2]
        std = 0.02
        # GPT-2 scales the residual projections down so the residual stream's variance does not
        # grow with depth.
        residual_std = std / math.sqrt(2 * self.args.n_layers)
        norms = ("attention_norm", "ffn_norm", "norm")
        if leaf == "bias" and parent in ("wq", "wk", "wv", "wo", "w1", "w2", *norms):
            nn.init.zeros_(full)
        elif leaf != "weight":
            raise KeyError(f"GPT2.init_param: unknown parameter {name!r}")
        elif parent in norms:
            nn.init.ones_(full)
        elif parent in ("tok_embeddings", "output", "wq", "wk", "wv", "w1"):
            nn.init.normal_(full, mean=0.0, std=std, generator=generator)
        elif parent in ("wo", "w2"):
            nn.init.normal_(full, mean=0.0, std=residual_std, generator=generator)
        elif parent == "pos_embeddings":
            nn.init.normal_(full, mean=0.0, std=0.01, generator=generator)
        else:
            raise KeyError(f"GPT2.init_param: unknown parameter {name!r}")


if TYPE_CHECKING:  # mypy (.ci/run) holds the class to the model interface and names any member that differs

    def _implements_decoder(model: GPT2) -> Decoder:
        return model
