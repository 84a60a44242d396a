"""GPT-2 on the shared decoder (titanlite/models/common/decoder.py): learned positions, pre-LayerNorm blocks,
attention with biases and no rotations, a GELU MLP, tied embeddings, no dropout.
Plain modules with no parallelism inside; the trainer shards them from outside."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from torch import nn

from titanlite.models.common.decoder import Transformer
from titanlite.models.common.feed_forward import MLP
from titanlite.models.common.init_scheme import InitScheme, NormalInit
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

    def init_scheme(self) -> InitScheme:
        """GPT-2's: plain normal draws (std 0.02, the residual-side projections 0.02 / sqrt(2 n_layers)), the learned
        positions std 0.01."""
        return NormalInit(self.args.n_layers, self.args.dim, self.args.tie_embeddings, position_std=0.01)


if TYPE_CHECKING:  # mypy (.ci/run) holds the class to the model interface and names any member that differs

    def _implements_decoder(model: GPT2) -> Decoder:
        return model
