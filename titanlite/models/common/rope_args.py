"""Rotary scaling's arguments, torch-free (the frequencies are titanlite/models/common/rope.py): Llama 3.1's
(rope_type "llama3") and YaRN (rope_type "yarn"), shared by every family whose config.json asks for them; and
`LayerRope`, the rotary settings of one layer kind (DecoderArgs.layer_rope)."""

from __future__ import annotations

import math
from dataclasses import dataclass


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched `factor` times: 0.1 * mscale * ln(factor) + 1,
    and 1 when the context is not stretched."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1/3.2's RoPE frequency scaling (config.json rope_scaling with rope_type "llama3"): rotations
    slower than the original context are slowed by `factor`, fast ones are kept, and those in between are
    blended, so the model reads long contexts without retraining its short-range positions."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN (Peng et al., 2023; config.json rope_scaling / rope_parameters with rope_type "yarn"): the
    frequencies that turn fewer than beta_slow times over the original context are divided by `factor`
    (interpolated), those turning more than beta_fast times are kept (extrapolated), those in between blended
    linearly by dimension; and cos and sin are multiplied by `attention_scale`, which sharpens the softmax."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    """With mscale_all_dim (DeepSeek's configs), attention_scale is yarn_mscale(factor, mscale) /
    yarn_mscale(factor, mscale_all_dim); 0: not given."""
    mscale_all_dim: float = 0.0
    attention_factor: float = 0.0
    """config.json's attention_factor: attention_scale itself; 0: derived from factor (and the mscales)."""
    truncate: bool = True
    """Round the blended band's bounds to whole dimensions (transformers' default; gpt-oss sets false)."""

    def __post_init__(self) -> None:
        if self.factor < 1:
            raise ValueError(f"YaRN factor={self.factor}; it must be at least 1")
        if self.original_max_position_embeddings < 1:
            raise ValueError("YaRN original_max_position_embeddings must be a positive context length")
        if self.beta_fast <= self.beta_slow or self.beta_slow <= 0:
            raise ValueError(
                f"YaRN needs beta_fast > beta_slow > 0, not beta_fast={self.beta_fast}, beta_slow={self.beta_slow}"
            )
        for name in ("mscale", "mscale_all_dim", "attention_factor"):
            if getattr(self, name) < 0:
                raise ValueError(f"YaRN {name}={getattr(self, name)}; it must not be negative")

    @property
    def attention_scale(self) -> float:
        """The factor on cos and sin (transformers' attention_factor)."""
        if self.attention_factor:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)


# config.json keys of a YaRN rope_scaling, other than rope_type and factor, that titanlite reads.
YARN_KEYS = (
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
    "truncate",
)


def yarn_from_hf(rope: dict, where: str, config: dict) -> YarnRopeScaling:
    """A YaRN rope_scaling / rope_parameters dict of config.json `config` as YarnRopeScaling; ValueError naming
    the key at fault. As transformers reads it: a top-level original_max_position_embeddings comes first, then
    the dict's, then max_position_embeddings."""
    longest = config.get("max_position_embeddings")
    original = config.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings") or longest
    if not original:
        raise ValueError(f"{where} of rope_type 'yarn' lacks 'original_max_position_embeddings'")
    factor = rope.get("factor")
    if factor is None:
        raise ValueError(f"{where} of rope_type 'yarn' lacks 'factor'")
    fields = {k: rope[k] for k in YARN_KEYS if rope.get(k) is not None}
    fields["original_max_position_embeddings"] = int(original)
    return YarnRopeScaling(factor=float(factor), **fields)


def yarn_to_hf(scaling: YarnRopeScaling) -> dict:
    """The config.json form (rope_type "yarn"), every field written so any reader rebuilds the same frequencies."""
    fields = {
        "rope_type": "yarn",
        "factor": scaling.factor,
        "original_max_position_embeddings": scaling.original_max_position_embeddings,
        "beta_fast": scaling.beta_fast,
        "beta_slow": scaling.beta_slow,
        "truncate": scaling.truncate,
    }
    for name in ("mscale", "mscale_all_dim", "attention_factor"):
        if getattr(scaling, name):
            fields[name] = getattr(scaling, name)
    return fields


@dataclass(frozen=True)
class LayerRope:
    """The rotary settings of the layers of one kind ("full_attention", "sliding_attention": DecoderArgs.layer_rope,
    config.json's rope_parameters keyed by layer type): base `theta`, an optional frequency `scaling` (Llama 3.1's
    or YaRN), a `linear_factor` dividing every frequency (rope_type "linear"), and the rotated channels of each head:
    `rotary_dim` leading ones (0: the whole head; transformers' partial_rotary_factor times head_dim), with
    frequencies theta^(-2i / frequency_dim) (0: rotary_dim, the usual; the head width for Gemma 4's
    "proportional" RoPE, whose unrotated pairs have frequency zero)."""

    theta: float
    scaling: Llama3RopeScaling | YarnRopeScaling | None = None
    linear_factor: float = 1.0
    rotary_dim: int = 0
    frequency_dim: int = 0

    def __post_init__(self) -> None:
        if self.linear_factor <= 0:
            raise ValueError(f"LayerRope linear_factor={self.linear_factor}; it must be positive")
        if self.rotary_dim < 0 or self.rotary_dim % 2:
            raise ValueError(f"LayerRope rotary_dim={self.rotary_dim}; rotations take pairs, so use an even number")
        if self.frequency_dim and self.scaling is not None:
            raise ValueError("LayerRope frequency_dim (proportional RoPE) takes no llama3 or yarn scaling")
