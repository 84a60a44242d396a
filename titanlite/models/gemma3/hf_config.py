"""Gemma 3's text config.json (model_type "gemma3_text", Gemma3ForCausalLM), both ways, torch-free. Reads
transformers 5's rope_parameters (one entry per layer type) and 4.x's top-level rope_theta, rope_local_base_freq,
rope_scaling and sliding_window_pattern; what Gemma 3 does not use (softcapping, bidirectional attention, other
RoPE types or activations) is refused in one line naming the field."""

from __future__ import annotations

from titanlite.base.hf_config import COUNT, FLAG, NUMBER, POSITIVE, TEXT, FieldTypes, refuse
from titanlite.models.common.decoder_args import window_of
from titanlite.models.common.decoder_config import decoder_fields, decoder_sizes, layer_types_of
from titanlite.models.gemma3.args import Gemma3Args, layer_types

# The config.json fields Gemma 3 reads beyond the shared ones (titanlite/base/hf_config.py FIELDS).
FIELDS: FieldTypes = {
    "hidden_activation": (TEXT, True),
    "rope_local_base_freq": (POSITIVE, False),
    "sliding_window_pattern": (COUNT, False),
    "query_pre_attn_scalar": (POSITIVE, False),
    "final_logit_softcapping": (NUMBER, True),
    "attn_logit_softcapping": (NUMBER, True),
    "use_bidirectional_attention": (FLAG, True),
}

MODEL_TYPE = "gemma3_text"
ACTIVATION = "gelu_pytorch_tanh"


def refuse_unused(config: dict, where: str) -> None:
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if config.get(key) is not None:
            raise refuse(where, key, config[key], "Gemma 3 has no logit softcapping; titanlite does not implement it")
    if config.get("use_bidirectional_attention"):
        raise refuse(where, "use_bidirectional_attention", True, "titanlite's attention is causal")
    for key in ("hidden_activation", "hidden_act"):
        if config.get(key, ACTIVATION) != ACTIVATION:
            raise refuse(where, key, config[key], f"Gemma 3's MLP is {ACTIVATION!r}")


def rope_of(config: dict, where: str) -> tuple[float, float, float]:
    """(rope_theta, rope_local_theta, linear factor of the full layers)."""
    params = config.get("rope_parameters") or {}
    if params and set(params) <= {"full_attention", "sliding_attention"}:  # transformers 5
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        key = "rope_parameters"
    else:  # transformers 4.x's top-level fields
        full = {**(config.get("rope_scaling") or {}), "rope_theta": config.get("rope_theta", 1e6)}
        local = {"rope_theta": config.get("rope_local_base_freq", 10000.0)}
        key = "rope_scaling"
    full_type = full.get("rope_type") or full.get("type") or "default"
    if full_type not in ("default", "linear"):
        raise refuse(where, f"{key} rope_type", full_type, "Gemma 3's full layers take default or linear RoPE")
    local_type = local.get("rope_type") or local.get("type") or "default"
    if local_type != "default":
        raise refuse(
            where, "rope_parameters sliding_attention rope_type", local_type, "sliding layers' RoPE is default"
        )
    factor = float(full.get("factor", 1.0)) if full_type == "linear" else 1.0
    return float(full.get("rope_theta", 1e6)), float(local.get("rope_theta", 10000.0)), factor


def read(config: dict, where: str) -> Gemma3Args:
    """Gemma3Args of a gemma3_text config.json."""
    refuse_unused(config, where)
    sizes = decoder_sizes(config, where, max_seq_len=131072, tie=True)
    n_layers = sizes["n_layers"]
    kinds = tuple(layer_types_of(config, where)) or layer_types(n_layers, config.get("sliding_window_pattern", 6))
    if len(kinds) != n_layers:
        raise refuse(where, "layer_types", f"[{len(kinds)} entries]", f"it needs one per layer ({n_layers})")
    window = config.get("sliding_window") or 0
    if "sliding_attention" not in kinds:
        window, kinds = 0, ()
    elif not window:
        raise refuse(where, "sliding_window", config.get("sliding_window"), "its sliding layers need a window")
    rope_theta, rope_local_theta, factor = rope_of(config, where)
    bias = bool(config.get("attention_bias"))
    return Gemma3Args(
        **sizes,
        rope_theta=rope_theta,
        qkv_bias=bias,
        out_bias=bias,
        sliding_window=window,
        layer_types=kinds,
        query_pre_attn_scalar=config.get("query_pre_attn_scalar", 256),
        rope_local_theta=rope_local_theta,
        rope_linear_factor=factor,
    )


def write(args: Gemma3Args) -> dict:
    """The gemma3_text config.json fields of this model (both RoPE forms, for transformers 5 and 4.x)."""
    if args.qkv_bias != args.out_bias or args.mlp_bias:
        raise refuse(
            "a gemma3 config.json", "qkv_bias/out_bias/mlp_bias", (args.qkv_bias, args.out_bias, args.mlp_bias),
            "Gemma 3 has one attention_bias and no MLP biases",
        )  # fmt: skip
    kinds = ["sliding_attention" if window_of(args, i) else "full_attention" for i in range(args.n_layers)]
    full = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_linear_factor != 1.0:
        full = {"rope_type": "linear", "factor": args.rope_linear_factor, "rope_theta": args.rope_theta}
    return {
        **decoder_fields(args, "Gemma3ForCausalLM", MODEL_TYPE, ("hidden_activation", ACTIVATION)),
        "query_pre_attn_scalar": args.query_pre_attn_scalar,
        # Without sliding layers the window is unused; transformers still builds its mask from a number.
        "sliding_window": args.sliding_window or args.max_seq_len,
        "layer_types": kinds,
        "rope_parameters": {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": args.rope_local_theta},
        },
        "rope_theta": args.rope_theta,
        "rope_local_base_freq": args.rope_local_theta,
        "rope_scaling": {k: v for k, v in full.items() if k != "rope_theta"}
        if args.rope_linear_factor != 1.0
        else None,
        "attention_bias": args.qkv_bias,
        "attention_dropout": 0.0,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
    }
