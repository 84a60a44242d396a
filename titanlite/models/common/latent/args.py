"""Multi-head latent attention's arguments, torch-free (titanlite/models/common/latent/model.py builds the attention):
the query's and the latent's ranks, each head's widths, their checks, and what the shared decoder, the FLOP count and
the planner read of them. A family's arguments derive from LatentArgs and add their own shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from titanlite.models.common.decoder_args import TransformerArgs, TransformerDefaults
from titanlite.models.common.rope_args import YarnRopeScaling, yarn_mscale


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
