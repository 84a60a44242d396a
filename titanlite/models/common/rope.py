"""Rotary position embedding frequencies shared by the families: plain RoPE and YaRN's scaling
(titanlite/models/common/rope_args.py holds its arguments)."""

import math

import torch

from titanlite.models.common.rope_args import YarnRopeScaling


def rope_frequencies(rotary_dim: int, theta: float, device=None) -> torch.Tensor:
    """theta^(-2i / rotary_dim) for i < rotary_dim / 2, in float32."""
    exponents = torch.arange(0, rotary_dim, 2, device=device, dtype=torch.float32) / rotary_dim
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
