"""Multi-head latent attention's arguments, torch-free (titanlite/models/common/latent/model.py builds the attention):
the query's and the latent's ranks, each head's widths, their checks, and what the shared decoder, the FLOP count and
the planner read of them. A family's arguments derive from LatentArgs and add their own shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from titanlite.models.common.decoder_args import TransformerArgs, TransformerDefaults
from titanlite.models.common.rope_args import YarnRopeScaling, yarn_mscale


@dataclass(frozen=True)
class IndexerArgs:
    """DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2, GLM-5; titanlite/models/common/latent/sparse.py):
    the shape of each layer's indexer and how many keys it keeps, and how the run trains it."""

    n_heads: int = 64
    """The indexer's heads (config.json index_n_heads)."""
    head_dim: int = 128
    """Each indexer head's width (index_head_dim); its first qk_rope_head_dim channels rotate."""
    topk: int = 2048
    """The keys each query attends to (index_topk); where a query sees no more than that, it attends to all."""
    interleaved: bool = False
    """How the indexer rotates its rotary channels: adjacent pairs (GLM-5), or halves (DeepSeek-V3.2)."""
    loss_coefficient: float = 1.0
    """The indexer loss's weight in the training loss (training.indexer_loss_coefficient); not math."""
    dense_warmup: bool = False
    """Attend densely and train the indexer alone (training.indexer_dense_warmup); not math."""

    TRAINING = ("loss_coefficient", "dense_warmup")  # how the run trains it, not what the weights compute

    def check(self, rope_dim: int, q_lora_rank: int) -> None:
        """A ValueError, in config.json's words, for an indexer the model cannot build."""
        if self.n_heads < 1 or self.head_dim < 1:
            raise ValueError(f"index_n_heads={self.n_heads}, index_head_dim={self.head_dim}; both must be at least 1")
        if self.topk < 1:
            raise ValueError(f"index_topk={self.topk}; each query must attend to at least 1 key")
        if self.head_dim < rope_dim:
            raise ValueError(
                f"index_head_dim={self.head_dim} cannot hold the qk_rope_head_dim={rope_dim} channels it rotates"
            )
        if not q_lora_rank:
            raise ValueError("q_lora_rank=null; the indexer's queries are read from the query's low-rank residual")


@dataclass(kw_only=True)
class LatentArgs(TransformerDefaults):
    """Multi-head latent attention (DeepSeek-V2/V3; titanlite/models/common/mixers.py LatentAttention): each head's
    key and value expanded from one compressed latent, one rotary key shared by every head. Keyword-only fields, so
    that a family's own (dim, n_layers, n_heads, ...) keep their places; the family gives n_heads, the heads."""

    latent_rotary: ClassVar[bool] = True
    """Whether the qk_rope_head_dim channels rotate (DeepSeek's); False keeps them unrotated, and the decoder builds no
    rotary table for the latent layers (Kimi Linear's)."""
    q_lora_rank: int = 0
    """Rank of the query's low-rank projection (q_a_proj, its norm, q_b_proj); 0: one q_proj (DeepSeek-V2-Lite)."""
    kv_lora_rank: int = 512
    """Width of the compressed key/value latent every head's key and value are expanded from (kv_b_proj)."""
    qk_nope_head_dim: int = 128
    """Each head's query/key channels without rotary position (the key's from the latent)."""
    qk_rope_head_dim: int = 64
    """Each head's rotary query channels; the rotary key of this width is one, shared by every head (kept but not
    rotated where latent_rotary is False)."""
    v_head_dim: int = 128
    indexer: IndexerArgs | None = None
    """DeepSeek Sparse Attention's indexer on every layer (IndexerArgs); None: every query attends to every earlier
    key."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.latent_rotary and (self.qk_rope_head_dim % 2 or self.qk_rope_head_dim < 2):
            raise ValueError(f"{name}.qk_rope_head_dim={self.qk_rope_head_dim}; RoPE rotates pairs")
        for field in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            if getattr(self, field) < 1:
                raise ValueError(f"{name}.{field}={getattr(self, field)}; it must be at least 1")
        for field in ("q_lora_rank", "qk_rope_head_dim"):
            if getattr(self, field) < 0:
                raise ValueError(f"{name}.{field}={getattr(self, field)}; use 0 (none) or more")
        if self.indexer is not None:
            self.indexer.check(self.qk_rope_head_dim, self.q_lora_rank)

    @property
    def qk_head_dim(self) -> int:
        """Each head's query and key width: the non-rotary channels, then the rotary ones."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def n_kv_heads(self: TransformerArgs) -> int:
        """Every head has its own key and value (expanded from the shared latent)."""
        return self.n_heads

    @property
    def head_dim(self) -> int:
        """The mean of the key and value head widths, what the shared FLOP formula and the planner read
        (12 * L * H * head_dim * T is attention's 6 * L * H * (qk_head_dim + v_head_dim) * T)."""
        return (self.qk_head_dim + self.v_head_dim) // 2

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim**-0.5, times yarn_mscale(factor, mscale_all_dim)**2 under YaRN with mscale_all_dim (as
        transformers scales DeepSeek-V3's scores)."""
        scale = self.qk_head_dim**-0.5
        yarn = self.rope_scaling
        if isinstance(yarn, YarnRopeScaling) and yarn.mscale_all_dim:
            scale *= yarn_mscale(yarn.factor, yarn.mscale_all_dim) ** 2
        return scale
