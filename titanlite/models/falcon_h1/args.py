"""Falcon-H1's arguments, torch-free: the shared decoder's with a Mamba-2 mixer (Mamba2Args,
titanlite/models/common/mamba2_args.py) beside the attention in every layer, and the multipliers that scale what each
part reads and writes (Falcon-H1 was trained with muP, and its published weights expect them); the published sizes."""

from __future__ import annotations

import math
from dataclasses import dataclass

from titanlite.models.common.mamba2_args import Mamba2Args
from titanlite.models.spec import not_math

ONES5 = (1.0, 1.0, 1.0, 1.0, 1.0)
# The multipliers of one number each (config.json's <part>_multiplier)
SCALAR_MULTIPLIERS = ("embedding", "lm_head", "attention_in", "attention_out", "key", "ssm_in", "ssm_out")


@dataclass
class FalconH1Args(Mamba2Args):
    """Falcon-H1's decoder (titanlite/models/falcon_h1/model.py): n_layers layers, each one RMSNorm whose output feeds
    grouped-query attention with RoPE (keys times key_multiplier) and a Mamba-2 mixer side by side, their outputs
    added into the residual, then a SwiGLU MLP behind its own RMSNorm. Every multiplier is config.json's field of the
    same name; 1.0 leaves its tensor as it is."""

    family: str = not_math("falcon_h1")
    mamba_out_bias: bool = False
    """A bias on the Mamba output projection (projectors_bias; mamba_bias is mamba_proj_bias, the input's)."""
    mamba_gated_norm: bool = False
    """The Mamba output's gated RMSNorm over mamba_norm_groups slices (mamba_rms_norm); without it the scan's output is
    gated by SiLU(z) alone."""
    mamba_norm_before_gate: bool = True
    """That norm before the gate (mamba_norm_before_gate), or the gate first."""
    embedding_multiplier: float = 1.0
    """The token embeddings times it."""
    lm_head_multiplier: float = 1.0
    """The logits times it."""
    attention_in_multiplier: float = 1.0
    """The attention's input (the normed hidden states) times it."""
    attention_out_multiplier: float = 1.0
    """The attention's output times it, before the residual add."""
    key_multiplier: float = 1.0
    """The keys times it (ours: the attention scores' scale, key_multiplier / sqrt(head_dim), the same product)."""
    ssm_in_multiplier: float = 1.0
    """The Mamba mixer's input times it."""
    ssm_out_multiplier: float = 1.0
    """The Mamba mixer's output times it, before the residual add."""
    ssm_multipliers: tuple[float, float, float, float, float] = ONES5
    """The Mamba projections' outputs z, x, B, C and dt each times its own (transformers' mup_vector)."""
    mlp_multipliers: tuple[float, float] = (1.0, 1.0)
    """The MLP's gate projection times the first (inside the activation), its output times the second."""

    def __post_init__(self) -> None:
        self.ssm_multipliers = tuple(float(m) for m in self.ssm_multipliers)  # type: ignore[assignment]
        self.mlp_multipliers = tuple(float(m) for m in self.mlp_multipliers)  # type: ignore[assignment]
        super().__post_init__()
        name = type(self).__name__
        if len(self.ssm_multipliers) != 5 or len(self.mlp_multipliers) != 2:
            raise ValueError(f"{name}: ssm_multipliers holds five numbers (z, x, B, C, dt), mlp_multipliers two")
        if self.layer_types or self.sliding_window or self.nope_layers or self.layer_rope:
            raise ValueError(f"{name}: every layer is alike, full attention with RoPE beside a Mamba-2 mixer")
        if self.qk_norm != "none" or self.norm_position != "pre" or self.rotary_dim != self.head_dim:
            raise ValueError(f"{name}: no Q/K norms, pre-norm layers, RoPE over whole heads")
        if self.qkv_bias != self.out_bias:
            raise ValueError(f"{name}: one attention_bias on every attention projection")
        multipliers = (*self.ssm_multipliers, *self.mlp_multipliers)
        scalars = (getattr(self, f"{part}_multiplier") for part in SCALAR_MULTIPLIERS)
        if not all(math.isfinite(m) for m in (*multipliers, *scalars)):
            raise ValueError(f"{name}: every multiplier must be a finite number")


FLAVORS = {
    # Tiny, for tests and CPU runs: grouped B and C (two groups of four heads), grouped key/value heads, the gated
    # output norm, and the published kind of multipliers (all but attention_in_multiplier off one), so each shows in
    # the losses.
    "debug": FalconH1Args(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=128,
        vocab_size=0,
        max_seq_len=2048,
        rope_theta=1e11,
        mamba_heads=8,
        mamba_head_dim=8,
        mamba_groups=2,
        state_dim=16,
        mamba_chunk_size=16,
        mamba_gated_norm=True,
        embedding_multiplier=2.0,
        lm_head_multiplier=0.5,
        attention_out_multiplier=0.9375,
        key_multiplier=0.5,
        ssm_in_multiplier=1.25,
        ssm_out_multiplier=0.5,
        ssm_multipliers=(0.5, 0.5, 0.5, 1.0, 0.5),
        mlp_multipliers=(0.875, 0.5),
    ),
    # Falcon-H1-0.5B (tiiuae/Falcon-H1-0.5B-Instruct's config.json, as Megatron-Bridge's Falcon-H1 bridge tests and
    # mlx-lm's falcon_h1 defaults carry it): 36 layers of width 1024, attention 8 heads over 2 key/value heads of 64,
    # Mamba-2 24 heads of 64 over one group of state 128, no output norm, the muP multipliers it was trained with.
    "falcon_h1_0.5b": FalconH1Args(
        dim=1024,
        n_layers=36,
        n_heads=8,
        n_kv_heads=2,
        head_dim=64,
        ffn_dim=2048,
        vocab_size=32784,
        max_seq_len=16384,
        rope_theta=1e11,
        mamba_heads=24,
        mamba_head_dim=64,
        mamba_groups=1,
        state_dim=128,
        embedding_multiplier=5.656854249492381,
        lm_head_multiplier=0.0390625,
        attention_out_multiplier=0.9375,
        key_multiplier=0.39062499999999994,
        ssm_in_multiplier=1.25,
        ssm_out_multiplier=0.23570226039551587,
        ssm_multipliers=(0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738),
        mlp_multipliers=(0.8838834764831844, 0.5859375),
        mamba_norm_before_gate=False,
    ),
}
