"""GLM-4.5 on the shared decoder (titanlite/models/common/decoder.py): pre-norm blocks of grouped-query attention (QKV
biases, optional per-head Q/K norms, rotations of the leading rotary_dim channels of each head, in adjacent pairs) and
the shared mixture-of-experts block (titanlite/models/common/moe/layer.py: sigmoid scores, group-limited top-k, the
routing bias, shared experts), the first moe.dense_layers with a dense SwiGLU. No parallelism inside; multi-token
prediction is not built."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from titanlite.models.common.decoder import Transformer, grouped_query_attention
from titanlite.models.common.interface import Decoder
from titanlite.models.common.rope import RotaryTable
from titanlite.models.glm4_moe.args import Glm4MoeArgs


def partial_rotary_attention(model: Transformer, layer: int) -> nn.Module:
    """The shared attention, rotating the leading rotary_dim channels of each head."""
    return grouped_query_attention(model, layer, rotary_dim=model.args.rotary_dim)


class Glm4Moe(Transformer):
    """Implements titanlite.models.common.interface.Decoder."""

    args: Glm4MoeArgs
    mixers = {"full_attention": partial_rotary_attention}

    def rotary_tables(self) -> dict[str, RotaryTable]:
        a = self.args
        return {"rope": RotaryTable(a.rotary_dim, a.rope_theta, a.rope_scaling)}


if TYPE_CHECKING:  # mypy holds the class to the model interface and names any member that differs

    def _implements_decoder(model: Glm4Moe) -> Decoder:
        return model
