"""The Mamba-2 layers' arguments, torch-free: the shared decoder's arguments with Mamba-2 mixers
(titanlite/models/common/mamba2.py) beside attention, which the state-space hybrid families' (Nemotron-H) extend: the
mixer's heads, groups, state, convolution and step limits, their checks, and what a tensor-parallel degree must
divide."""

from __future__ import annotations

import math
from dataclasses import dataclass

from titanlite.base.hf_config import COUNT, FLAG, FieldTypes, refuse
from titanlite.models.common.decoder_args import DecoderArgs, tp_split_sizes
from titanlite.models.spec import not_math

INFINITY = {"__float__": "Infinity"}  # how transformers 5 writes float("inf") into a config.json (and reads it)
# The config.json fields of the Mamba-2 layers under the mamba_* names Granite 4.0 H and Falcon-H1 share, and their
# JSON types (check_types' table, titanlite/base/hf_config.py); mamba_d_head ("auto" or a count) each family reads.
MAMBA_FIELDS: FieldTypes = {
    "mamba_n_heads": (COUNT, False),
    "mamba_n_groups": (COUNT, False),
    "mamba_d_state": (COUNT, False),
    "mamba_d_conv": (COUNT, False),
    "mamba_expand": (COUNT, False),
    "mamba_chunk_size": (COUNT, False),
    "mamba_conv_bias": (FLAG, False),
    "mamba_proj_bias": (FLAG, False),
}


@dataclass
class Mamba2Args(DecoderArgs):
    """The shared decoder with Mamba-2 mixers: `mamba_heads` heads of `mamba_head_dim` (the inner width their
    product), `mamba_groups` groups of B and C of width `state_dim`, a convolution over `conv_size` tokens (biased
    where `conv_bias`), the step clamped below at `dt_min` and above at `dt_max`, the output norm over
    `mamba_norm_groups` slices of the inner width (0: mamba_groups). The defaults are Nemotron-H's."""

    mamba_heads: int = 128
    """Heads of the Mamba-2 layers (mamba_num_heads); each reads B and C of group h // (mamba_heads / mamba_groups)."""
    mamba_head_dim: int = 64
    """Each head's width P (mamba_head_dim): its state is [state_dim, P]."""
    mamba_groups: int = 8
    """Groups of the input-dependent B and C (n_groups), shared by mamba_heads / mamba_groups heads each."""
    state_dim: int = 128
    """The state's width N (ssm_state_size)."""
    conv_size: int = 4
    """Width of the causal convolution over the inputs, B and C (conv_kernel)."""
    conv_bias: bool = True
    """A bias on that convolution (use_conv_bias)."""
    mamba_bias: bool = False
    """Biases on the mixer's input and output projections."""
    dt_min: float = 0.0
    """The step dt = softplus(. + dt_bias) clamped below at it."""
    dt_max: float = math.inf
    """... and above at it."""
    mamba_norm_groups: int = 0
    """The gated output norm normalises each of this many equal slices of the inner width on its own (0:
    mamba_groups, one per group of heads)."""
    mamba_chunk_size: int = not_math(128)
    """Tokens per chunk of the SSD scan (chunk_size): how it computes, not what."""
    dt_init_min: float = not_math(0.001)
    """dt_bias starts as the softplus inverse of a step log-uniform in [dt_init_min, dt_init_max] (time_step_min, max),
    floored at dt_init_floor (time_step_floor)."""
    dt_init_max: float = not_math(0.1)
    dt_init_floor: float = not_math(1e-4)

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        for field in ("mamba_heads", "mamba_head_dim", "mamba_groups", "state_dim", "conv_size", "mamba_chunk_size"):
            if getattr(self, field) < 1:
                raise ValueError(f"{name}.{field}={getattr(self, field)}; it must be at least 1")
        if self.mamba_heads % self.mamba_groups:
            raise ValueError(
                f"{name}.mamba_heads={self.mamba_heads} must be a multiple of mamba_groups={self.mamba_groups}"
            )
        if not self.mamba_norm_groups:
            self.mamba_norm_groups = self.mamba_groups
        if self.mamba_width % self.mamba_norm_groups:
            raise ValueError(
                f"{name}.mamba_norm_groups={self.mamba_norm_groups} must divide the inner width "
                f"mamba_heads x mamba_head_dim = {self.mamba_width}"
            )
        if not 0.0 <= self.dt_min < self.dt_max:
            raise ValueError(f"{name}: dt_min={self.dt_min} and dt_max={self.dt_max} need 0 <= dt_min < dt_max")

    @property
    def mamba_width(self) -> int:
        """The Mamba-2 layers' inner width: mamba_heads x mamba_head_dim."""
        return self.mamba_heads * self.mamba_head_dim


def mamba_split_sizes(args: Mamba2Args) -> dict[str, int]:
    """What a tensor-parallel degree must divide: the attention's heads, the MLP's width, the vocabulary, and the
    Mamba-2 layers' groups (each rank holds whole groups of B and C and the heads that read them) and their output
    norm's slices (each rank normalises whole slices)."""
    return tp_split_sizes(args) | {"mamba_groups": args.mamba_groups, "mamba_norm_groups": args.mamba_norm_groups}


def step_limit(value: object, where: str) -> tuple[float, float]:
    """config.json's time_step_limit, [low, high], as the bounds the step is clamped to (Granite 4.0 H's and
    Falcon-H1's): high may be infinite (Infinity, or transformers 5's {"__float__": "Infinity"}); refused in one line
    unless two numbers with 0 <= low < high."""
    bounds = []
    for bound in value if isinstance(value, (list, tuple)) and len(value) == 2 else ():
        if bound == INFINITY or bound == math.inf:
            bounds.append(math.inf)
        elif isinstance(bound, (int, float)) and not isinstance(bound, bool) and math.isfinite(bound):
            bounds.append(float(bound))
    if len(bounds) != 2 or not 0.0 <= bounds[0] < bounds[1]:
        raise refuse(where, "time_step_limit", value, "it must be [low, high] with 0 <= low < high (high may be inf)")
    return bounds[0], bounds[1]


def step_limit_fields(low: float, high: float) -> dict:
    """config.json's time_step_limit as transformers 5 writes it (an infinite bound as {"__float__": "Infinity"}),
    where it is not transformers' default, no clamp at all [0, inf] (Granite 4.0 H's and Falcon-H1's), which goes
    unsaid: a config of the tagged form cannot be built from the dict itself (it reads only from JSON)."""
    if (low, high) == (0.0, math.inf):
        return {}
    return {"time_step_limit": [low, INFINITY if high == math.inf else high]}
