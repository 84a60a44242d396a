"""Rotary position embeddings shared by the families: the frequencies (plain, Llama 3.1's scaling, YaRN's, linear),
the cos/sin tables a decoder keeps as buffers, and the rotation itself, of adjacent pairs (Meta's layout) or of halves
(Hugging Face's) (titanlite/models/common/rope_args.py holds the scalings' arguments)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from titanlite.models.common.rope_args import LayerRope, Llama3RopeScaling, YarnRopeScaling


def rope_frequencies(rotary_dim: int, theta: float, device=None, frequency_dim: int = 0) -> torch.Tensor:
    """theta^(-2i / rotary_dim) for i < rotary_dim / 2, in float32 (over frequency_dim instead, where given:
    Gemma 4's proportional RoPE)."""
    exponents = torch.arange(0, rotary_dim, 2, device=device, dtype=torch.float32) / (frequency_dim or rotary_dim)
    return 1.0 / (theta**exponents)


def yarn_frequencies(rotary_dim: int, theta: float, scaling: YarnRopeScaling, device=None) -> torch.Tensor:
    """YaRN's frequencies: dimension d turns original / (2 pi theta^(2d / rotary_dim)) times over the original
    context; the dimensions turning fewer than beta_slow times are divided by factor, those turning more than
    beta_fast times kept, and the band between blended linearly in d. (The attention scale on cos and sin is
    scaling.attention_scale, applied by the caller.)"""
    extrapolated = rope_frequencies(rotary_dim, theta, device)
    interpolated = extrapolated / scaling.factor
    context = scaling.original_max_position_embeddings

    def dimension_turning(rotations: float) -> float:
        # The (fractional) dimension whose frequency turns `rotations` times over the original context.
        return rotary_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_turning(scaling.beta_fast), dimension_turning(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if high == low:
        high += 0.001  # a band of width zero: a step, not a division by zero
    ramp = ((torch.arange(rotary_dim // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    # ramp 0: fast dimensions, kept; ramp 1: slow ones, interpolated.
    return interpolated * ramp + extrapolated * (1 - ramp)


def scale_rope_frequencies(inv_freq: torch.Tensor, scaling: Llama3RopeScaling) -> torch.Tensor:
    """Llama 3.1's frequency scaling: rotations slower than the original context are slowed by `factor`, fast
    ones kept, those in between blended."""
    wavelength = 2 * math.pi / inv_freq
    context = scaling.original_max_position_embeddings
    # 0 for wavelengths longer than context / low_freq_factor, 1 for those shorter than
    # context / high_freq_factor, linear in context / wavelength in between.
    span = scaling.high_freq_factor - scaling.low_freq_factor
    blend = ((context / wavelength - scaling.low_freq_factor) / span).clamp(0, 1)
    return (1 - blend) * inv_freq / scaling.factor + blend * inv_freq


@dataclass(frozen=True)
class RotaryTable:
    """One table of rotations a decoder keeps (its cos and sin buffers): `dim` rotated channels per head, base
    `theta`, an optional scaling (Llama 3.1's or YaRN), a linear factor dividing every frequency (Gemma 3's
    full layers), and the width the frequencies' exponents divide by (0: dim; LayerRope.frequency_dim)."""

    dim: int
    theta: float
    scaling: Llama3RopeScaling | YarnRopeScaling | None = None
    linear_factor: float = 1.0
    frequency_dim: int = 0

    @classmethod
    def of(cls, rope: LayerRope, rotary_dim: int) -> RotaryTable:
        """The table of a layer kind's rotary settings (DecoderArgs.layer_rope): over its own rotated channels, or
        `rotary_dim` (the decoder's: DecoderArgs.rotary_dim) where it names none."""
        return cls(rope.rotary_dim or rotary_dim, rope.theta, rope.scaling, rope.linear_factor, rope.frequency_dim)

    def compute(self, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the rotation angles, each [seq_len, dim // 2], in float32 (YaRN's scaled by its
        attention scale, as transformers applies it)."""
        scaling = self.scaling
        if isinstance(scaling, YarnRopeScaling):
            inv_freq = yarn_frequencies(self.dim, self.theta, scaling, device)
        else:
            inv_freq = rope_frequencies(self.dim, self.theta, device, self.frequency_dim)
            if scaling is not None:
                inv_freq = scale_rope_frequencies(inv_freq, scaling)
        if self.linear_factor != 1.0:
            inv_freq = inv_freq / self.linear_factor
        angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
        if isinstance(scaling, YarnRopeScaling):
            return angles.cos() * scaling.attention_scale, angles.sin() * scaling.attention_scale
        return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int | None = None) -> torch.Tensor:
    """Rotate adjacent pairs (x[2i], x[2i+1]) of x [B, T, H, hd], Meta's layout for Llama weights; with `rotary_dim`
    below hd, only the leading rotary_dim channels of each head (partial rotary), the rest passing unchanged."""
    if rotary_dim is not None and rotary_dim < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]], dim=-1)
    return rotate_pairs(x, cos[None, :, None, :], sin[None, :, None, :])  # tables [1, T, 1, hd/2]


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Every adjacent pair (x[2i], x[2i+1]) of x [..., 2 r] rotated by cos and sin [..., r], which broadcast against
    x's leading dimensions as given; in float32, back to x's dtype."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)  # each [..., r]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).type_as(x)


def apply_rope_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (x[i], x[i + hd/2]) of x [B, T, H, hd], Hugging Face's layout (rotate_half: no row of its
    weights is reordered on import), by the tables [T, r] for i < r; the other pairs pass unchanged (r < hd/2: Gemma
    4's proportional RoPE, whose other frequencies are zero)."""
    half, r = x.shape[-1] // 2, cos.shape[-1]
    x1, x2 = x[..., :r].float(), x[..., half : half + r].float()
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]  # [1, T, 1, r]
    turned = (x1 * cos - x2 * sin).type_as(x), (x2 * cos + x1 * sin).type_as(x)
    return torch.cat([turned[0], x[..., r:half], turned[1], x[..., half + r :]], dim=-1)
