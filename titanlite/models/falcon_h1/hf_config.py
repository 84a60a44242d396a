"""Falcon-H1's config.json both ways (model_type "falcon_h1", FalconH1ForCausalLM), torch-free. An absent key takes
FalconH1Config's default (transformers 5); every field that changes the math is honoured or refused in one line
naming it.

What transformers' model reads is what we build: attention_bias on the four attention projections, mamba_proj_bias
on the Mamba input projection and projectors_bias on its output one, mamba_conv_bias on its convolution, hidden_act
(silu) in the MLP and after the convolution, the mixer's width mamba_d_ssm (or mamba_expand x hidden_size) split into
mamba_n_heads heads of mamba_d_head, time_step_limit clamping the step, rms_norm_eps in every norm. A field its model
does not read, but whose value says the model is another than the one it builds, is refused: mamba_use_mlp false
(it builds the MLP in every layer), attn_layer_indices (it attends in every layer), a sliding window, a partial
rotary factor."""

from __future__ import annotations

import math

from titanlite.base.hf_config import COUNT, FLAG, NUMBER, TEXTS, FieldTypes, refuse
from titanlite.models.common.decoder_config import decoder_fields, decoder_sizes, rope_scaling_to_hf, rope_settings
from titanlite.models.common.mamba2_args import MAMBA_FIELDS, step_limit, step_limit_fields
from titanlite.models.falcon_h1.args import ONES5, SCALAR_MULTIPLIERS, FalconH1Args

MODEL_TYPE, ARCHITECTURE = "falcon_h1", "FalconH1ForCausalLM"
SCALARS = tuple(f"{part}_multiplier" for part in SCALAR_MULTIPLIERS)
FIELDS: FieldTypes = {
    "mamba_d_ssm": (COUNT, True),
    **MAMBA_FIELDS,
    "mamba_norm_before_gate": (FLAG, False),
    "mamba_rms_norm": (FLAG, False),
    "mamba_use_mlp": (FLAG, False),
    "projectors_bias": (FLAG, False),
    "layers_block_type": (TEXTS, True),
    **dict.fromkeys(SCALARS, (NUMBER, False)),
}
# FalconH1Config's defaults (transformers 5) of what a config.json may leave out
DEFAULTS = {
    "vocab_size": 128000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "mamba_d_ssm": 1024,
    "mamba_n_heads": 128,
    "mamba_d_head": "auto",
    "mamba_n_groups": 1,
    "mamba_d_state": 256,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 256,
    "mamba_conv_bias": True,
    "mamba_proj_bias": False,
    "mamba_norm_before_gate": True,
    "mamba_rms_norm": False,
    "time_step_limit": [0.0, math.inf],
    "projectors_bias": False,
    "mlp_multipliers": [1.0, 1.0],
    "ssm_multipliers": list(ONES5),
    **dict.fromkeys(SCALARS, 1.0),
}


def _numbers(c: dict, key: str, count: int, where: str) -> tuple[float, ...]:
    """config.json's list `key` of `count` finite numbers (null: ones, as transformers reads it)."""
    value = c[key]
    if value is None:
        return (1.0,) * count
    fine = isinstance(value, list) and len(value) == count
    if not fine or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value):
        raise refuse(where, key, value, f"it is a list of {count} finite numbers")
    return tuple(float(v) for v in value)


def _mamba_width(c: dict, where: str) -> tuple[int, int, int]:
    """The mixer's width (mamba_d_ssm, or mamba_expand x hidden_size where it is null), heads and head width
    (mamba_d_head, or the width over the heads where "auto"), as FalconH1Config derives and checks them."""
    width = c["mamba_d_ssm"] if c["mamba_d_ssm"] is not None else c["mamba_expand"] * c["hidden_size"]
    heads, head_dim = c["mamba_n_heads"], c["mamba_d_head"]
    if width % heads:
        raise refuse(where, "mamba_n_heads", heads, f"it must divide the Mamba width {width} (mamba_d_ssm)")
    if head_dim == "auto":
        head_dim = width // heads
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
        raise refuse(where, "mamba_d_head", head_dim, 'it is a whole number of at least 1, or "auto"')
    if head_dim * heads != width:
        raise refuse(
            where, "mamba_d_head", head_dim, f"mamba_n_heads={heads} heads of it must make mamba_d_ssm={width}"
        )
    if heads % c["mamba_n_groups"]:
        raise refuse(where, "mamba_n_heads", heads, f"it must be a multiple of mamba_n_groups={c['mamba_n_groups']}")
    return width, heads, head_dim


def _refuse_what_transformers_does_not_build(config: dict, c: dict, where: str) -> None:
    """Refuse the fields transformers' model does not read whose values ask for another model than it builds."""
    if c.get("hidden_act", "silu") != "silu":
        raise refuse(where, "hidden_act", c["hidden_act"], "transformers' Falcon-H1 MLP and convolution use silu here")
    if c.get("mamba_use_mlp") is False:
        raise refuse(where, "mamba_use_mlp", False, "transformers' Falcon-H1 builds the MLP in every layer")
    if c.get("attn_layer_indices") is not None:
        raise refuse(where, "attn_layer_indices", c["attn_layer_indices"], "transformers' Falcon-H1 attends in every "
                     "layer")  # fmt: skip
    if c.get("sliding_window"):
        raise refuse(where, "sliding_window", c["sliding_window"], "Falcon-H1's attention sees the whole sequence")
    if c.get("partial_rotary_factor", 1.0) != 1.0:
        raise refuse(where, "partial_rotary_factor", c["partial_rotary_factor"], "Falcon-H1 rotates whole heads")
    kinds = config.get("layer_types") or config.get("layers_block_type") or []
    if any(kind != "hybrid" for kind in kinds):
        raise refuse(where, "layer_types", sorted(set(kinds)), "every Falcon-H1 layer is 'hybrid'")


def read(config: dict, where: str) -> FalconH1Args:
    """FalconH1Args of a falcon_h1 config.json."""
    c = {**DEFAULTS, **config}
    _refuse_what_transformers_does_not_build(config, c, where)
    sizes = decoder_sizes(c, where, max_seq_len=8192)  # FalconH1Config's default, as in DEFAULTS
    rope_theta, rope_scaling = rope_settings(c, where)
    width, heads, head_dim = _mamba_width(c, where)
    low, high = step_limit(c["time_step_limit"], where)
    bias = bool(c.get("attention_bias"))
    return FalconH1Args(
        **sizes,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        qkv_bias=bias,
        out_bias=bias,
        mlp_bias=bool(c.get("mlp_bias")),
        mamba_heads=heads,
        mamba_head_dim=head_dim,
        mamba_groups=c["mamba_n_groups"],
        state_dim=c["mamba_d_state"],
        conv_size=c["mamba_d_conv"],
        conv_bias=c["mamba_conv_bias"],
        mamba_bias=c["mamba_proj_bias"],
        mamba_out_bias=c["projectors_bias"],
        dt_min=low,
        dt_max=high,
        mamba_chunk_size=c["mamba_chunk_size"],
        mamba_gated_norm=c["mamba_rms_norm"],
        mamba_norm_before_gate=c["mamba_norm_before_gate"],
        ssm_multipliers=_numbers(c, "ssm_multipliers", 5, where),  # type: ignore[arg-type]
        mlp_multipliers=_numbers(c, "mlp_multipliers", 2, where),  # type: ignore[arg-type]
        embedding_multiplier=float(c["embedding_multiplier"]),
        lm_head_multiplier=float(c["lm_head_multiplier"]),
        attention_in_multiplier=float(c["attention_in_multiplier"]),
        attention_out_multiplier=float(c["attention_out_multiplier"]),
        key_multiplier=float(c["key_multiplier"]),
        ssm_in_multiplier=float(c["ssm_in_multiplier"]),
        ssm_out_multiplier=float(c["ssm_out_multiplier"]),
    )


def write(args: FalconH1Args) -> dict:
    """The falcon_h1 config.json fields of this model."""
    if args.mamba_norm_groups != args.mamba_groups:
        raise ValueError("a falcon_h1 config.json normalises the Mamba output over its mamba_n_groups slices")
    expand = {"mamba_expand": args.mamba_width // args.dim} if args.mamba_width % args.dim == 0 else {}
    return {
        **decoder_fields(args, ARCHITECTURE, MODEL_TYPE),
        # transformers 5 reads rope_parameters; 4.x the top-level rope_theta and rope_scaling.
        "rope_theta": args.rope_theta,
        "rope_parameters": {"rope_theta": args.rope_theta, **rope_scaling_to_hf(args.rope_scaling)},
        "rope_scaling": rope_scaling_to_hf(args.rope_scaling) if args.rope_scaling else None,
        "attention_bias": args.qkv_bias,
        "attention_dropout": 0.0,
        "mlp_bias": args.mlp_bias,
        "mamba_d_ssm": args.mamba_width,
        "mamba_n_heads": args.mamba_heads,
        "mamba_d_head": args.mamba_head_dim,
        "mamba_n_groups": args.mamba_groups,
        "mamba_d_state": args.state_dim,
        "mamba_d_conv": args.conv_size,
        **expand,  # read by no code once mamba_d_ssm is given
        "mamba_chunk_size": args.mamba_chunk_size,
        "mamba_conv_bias": args.conv_bias,
        "mamba_proj_bias": args.mamba_bias,
        "projectors_bias": args.mamba_out_bias,
        "mamba_rms_norm": args.mamba_gated_norm,
        "mamba_norm_before_gate": args.mamba_norm_before_gate,
        "mamba_use_mlp": True,
        **step_limit_fields(args.dt_min, args.dt_max),
        "ssm_multipliers": list(args.ssm_multipliers),
        "mlp_multipliers": list(args.mlp_multipliers),
        **{name: getattr(args, name) for name in SCALARS},
    }
