"""The shared decoder with multi-head latent attention (titanlite/models/common/mixers.py LatentAttention) built from
a family's LatentArgs: the attention's builder and its rotary table (the attention starts its own parameters as
DeepSeek-V3 does). Plain modules with no parallelism inside; DeepSeek-V3's and Kimi Linear's modules derive from
LatentDecoder."""

from __future__ import annotations

from titanlite.models.common.decoder import Transformer
from titanlite.models.common.latent.args import LatentArgs
from titanlite.models.common.latent.sparse import Indexer, SparseLatentAttention
from titanlite.models.common.mixers import LatentAttention, LatentWidths
from titanlite.models.common.rope import RotaryTable


def latent_attention(model: Transformer, layer: int) -> LatentAttention:
    """The arguments' multi-head latent attention (LatentArgs), its rotary channels rotated where they say so; with
    an indexer (LatentArgs.indexer), DeepSeek Sparse Attention (models/common/latent/sparse.py)."""
    a = model.args
    assert isinstance(a, LatentArgs)  # a latent family's module builds it
    index = a.indexer
    if index is None:
        return LatentAttention(a.dim, a.n_heads, **latent_widths(a))
    indexer = Indexer(
        a.dim, a.q_lora_rank, index.n_heads, index.head_dim, a.qk_rope_head_dim, index.topk, index.interleaved
    )
    return SparseLatentAttention(
        a.dim,
        a.n_heads,
        indexer=indexer,
        dense_warmup=index.dense_warmup,
        loss_weight=index.loss_coefficient,
        **latent_widths(a),
    )


def latent_widths(a: LatentArgs) -> LatentWidths:
    """LatentAttention's keyword arguments of `a`: its ranks, widths, scale and rotation."""
    return LatentWidths(
        q_lora_rank=a.q_lora_rank,
        kv_lora_rank=a.kv_lora_rank,
        qk_nope_head_dim=a.qk_nope_head_dim,
        qk_rope_head_dim=a.qk_rope_head_dim,
        v_head_dim=a.v_head_dim,
        softmax_scale=a.softmax_scale,
        rotary=a.latent_rotary,
    )


class LatentDecoder(Transformer):
    """The shared decoder (Transformer) whose full-attention layers are multi-head latent attention, reading one rotary
    table over qk_rope_head_dim channels (none where the arguments' latent_rotary is False). A family adds its own
    mixer kinds to `mixers`; each module starts its own parameters (LatentAttention's as DeepSeek-V3 starts them)."""

    mixers = {"full_attention": latent_attention}

    def rotary_tables(self) -> dict[str, RotaryTable]:
        a = self.args
        assert isinstance(a, LatentArgs)
        return {"rope": RotaryTable(a.qk_rope_head_dim, a.rope_theta, a.rope_scaling)} if a.latent_rotary else {}
