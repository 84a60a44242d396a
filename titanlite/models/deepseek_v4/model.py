"""DeepSeek-V4 (DeepseekV4ForCausalLM) on the shared decoder (titanlite/models/common/decoder.py): `hc_mult` residual
streams with hyper-connections (titanlite/models/common/hyper_connections.py), each layer's attention of its kind
with its window, compressed keys and indexer (titanlite/models/common/compressed_attention.py), and the mixture of
experts with sqrt-softplus scores, clamped SwiGLUs and the first layers routed by their token table
(titanlite/models/common/moe/). Every norm is an RMSNorm computed in float32. No parallelism inside."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from titanlite.models.common.compressed_attention import (
    COMPRESSED_KINDS as LAYER_KINDS,
)
from titanlite.models.common.compressed_attention import CSA, SLIDING, CompressedAttention, CompressedIndexer
from titanlite.models.common.decoder import Transformer
from titanlite.models.common.hyper_connections import (
    HyperBlock,
    HyperConnection,
    HyperMultiTokenProjection,
    HyperStreams,
    widen_streams,
)
from titanlite.models.common.interface import Decoder
from titanlite.models.common.moe.layer import MoE
from titanlite.models.common.norms import Float32RMSNorm
from titanlite.models.common.rope import RotaryTable
from titanlite.models.deepseek_v4.args import DeepseekV4Args


def compressed_attention(model: Any, layer: int) -> nn.Module:
    """Layer `layer`'s attention of its kind (args.layer_types)."""
    a: DeepseekV4Args = model.args
    kind = model.layer_kind(layer)
    indexer = None
    if kind == CSA:
        indexer = CompressedIndexer(
            a.dim, a.q_lora_rank, a.index_n_heads, a.index_head_dim, a.csa_rate, a.index_topk, a.norm_eps
        )
    return CompressedAttention(
        a.dim, a.n_heads, a.head_dim, a.rotary_dim, a.q_lora_rank, a.o_groups, a.o_lora_rank, a.sliding_window,
        kind, a.norm_eps, rate=a.rate(layer), indexer=indexer, loss_weight=a.indexer_loss_coefficient,
    )  # fmt: skip


class DeepseekV4(Transformer):
    """Implements titanlite.models.common.interface.Decoder."""

    args: DeepseekV4Args
    mixers: ClassVar[dict] = dict.fromkeys(LAYER_KINDS, compressed_attention)
    last_stage_modules: ClassVar[tuple[str, ...]] = ("streams", "norm", "output")  # the hyper-head folds there
    pooled_balance = False  # its blocks balance by their routing biases

    def layer_kind(self, layer: int) -> str:
        return self.args.kind(layer)

    def build_layer(self, layer: int) -> nn.Module:
        a = self.args

        def connection() -> HyperConnection:
            return HyperConnection(a.hc_mult, a.dim, a.hc_sinkhorn_iters, a.hc_eps, a.norm_eps)

        hashed = a.moe.is_hashed(layer)
        return HyperBlock(self.build_mixer(layer), self.build_feed_forward(layer), self.build_norm, connection, hashed)

    def build_feed_forward(self, layer: int) -> nn.Module:
        a = self.args
        return MoE(a.dim, a.moe, hash_vocab=a.vocab_size if a.moe.is_hashed(layer) else 0)

    def build_ahead(self, layer: int) -> HyperMultiTokenProjection:
        a = self.args
        return HyperMultiTokenProjection(a.hc_mult, a.dim, self.build_norm, a.hc_eps, a.norm_eps)

    def build_norm(self) -> nn.Module:
        return Float32RMSNorm(self.args.dim, self.args.norm_eps)

    def build_streams(self) -> HyperStreams:
        a = self.args
        return HyperStreams(a.hc_mult, a.dim, a.hc_eps, a.norm_eps)

    def widen(self, h: torch.Tensor) -> torch.Tensor:
        return widen_streams(h, self.args.hc_mult)

    def rotary_tables(self) -> dict[str, RotaryTable]:
        """ "rope_main" (the sliding layers': rope_theta, plain) and "rope_compress" (the compressed layers':
        compress_rope_theta, with rope_scaling), each over rotary_dim channels."""
        a = self.args
        return {
            "rope_main": RotaryTable(a.rotary_dim, a.rope_theta),
            "rope_compress": RotaryTable(a.rotary_dim, a.compress_rope_theta, a.rope_scaling),
        }

    def rotary_of(self, layer: int) -> str | None:
        return "rope_main" if self.layer_kind(layer) == SLIDING else "rope_compress"

    def rotary_at(self, positions: torch.Tensor | None) -> dict[str | None, tuple]:
        """The whole tables, whatever the positions: each attention reads its queries' rows and its compressed
        keys' (their blocks' first positions)."""
        return super().rotary_at(None)

    @property
    def reads_token_ids(self) -> bool:
        return bool(self.args.moe.hash_layers)

    def layer_inputs(
        self, tokens: torch.Tensor, h: torch.Tensor, token_ids: torch.Tensor | None = None
    ) -> dict[str, dict[str, Any]] | None:
        """The token ids of the hash-routed layers' blocks."""
        hashed = self.args.moe.hash_layers
        if not hashed:
            return None
        return {name: {"tokens": token_ids} if int(name) in hashed else {} for name in self.layers}


if TYPE_CHECKING:  # mypy (.ci/run) holds the class to the model interface and names any member that differs

    def _implements_decoder(model: DeepseekV4) -> Decoder:
        return model
