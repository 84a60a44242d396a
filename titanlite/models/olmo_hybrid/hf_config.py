"""OLMo Hybrid's config.json both ways (model_type "olmo_hybrid", OlmoHybridForCausalLM), torch-free. transformers'
defaults fill what a config.json leaves out (the layer pattern, the linear layers' heads and widths); every field
that changes the math is honoured or refused in one line naming it."""

from __future__ import annotations

from titanlite.base.hf_config import FLAG, FieldTypes, refuse
from titanlite.models.common.decoder_config import decoder_fields, decoder_sizes
from titanlite.models.common.linear_attention_args import GATED_DELTA_NET_FIELDS, LAYER_KINDS
from titanlite.models.olmo_hybrid.args import OlmoHybridArgs, olmo_layers

# The config.json fields OLMo Hybrid reads beyond the shared ones (titanlite/base/hf_config.py FIELDS): the linear
# layers' (GatedDeltaNetArgs'), their doubled write strength.
FIELDS: FieldTypes = {**GATED_DELTA_NET_FIELDS, "linear_allow_neg_eigval": (FLAG, False)}

MODEL_TYPE = "olmo_hybrid"
ACTIVATION = "silu"
ROPE_THETA = 10000.0  # transformers' when config.json names none (a null one: no rotations)


def _count(config: dict, key: str, default: int, where: str) -> int:
    """A whole number of at least 1 (the linear layers' fields, which the shared type check does not know)."""
    value = config.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise refuse(where, key, value, "it must be a whole number of at least 1")
    return value


def _rope(config: dict, where: str) -> tuple[bool, float]:
    """Whether the attention layers rotate, and by which theta: a null rope_theta (the published checkpoints') turns
    rotations off, as transformers then builds no rotary embedding."""
    rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type != "default":
        raise refuse(where, "rope_parameters rope_type", rope_type, "OLMo Hybrid's rotations are the default ones")
    if "rope_theta" in rope:
        theta = rope["rope_theta"]
    else:
        theta = config.get("rope_theta", ROPE_THETA)
    return theta is not None, float(theta if theta is not None else ROPE_THETA)


def _layer_types(config: dict, where: str, n_layers: int) -> tuple[str, ...]:
    kinds = tuple(config.get("layer_types") or ()) or olmo_layers(n_layers)
    unknown = sorted(set(kinds) - set(LAYER_KINDS))
    if unknown:
        raise refuse(where, "layer_types", unknown[0], f"OLMo Hybrid's layers are {' or '.join(LAYER_KINDS)}")
    if len(kinds) != n_layers:
        raise refuse(where, "layer_types", f"[{len(kinds)} entries]", f"it needs one per layer ({n_layers})")
    if set(kinds) != set(LAYER_KINDS):
        raise refuse(where, "layer_types", sorted(set(kinds)), "OLMo Hybrid needs linear and full attention layers")
    return kinds


def read(config: dict, where: str) -> OlmoHybridArgs:
    """OlmoHybridArgs of an olmo_hybrid config.json."""
    if config.get("hidden_act", ACTIVATION) != ACTIVATION:
        raise refuse(
            where, "hidden_act", config["hidden_act"], f"OLMo Hybrid's MLP and convolutions use {ACTIVATION!r}"
        )
    if config.get("attention_bias"):
        raise refuse(where, "attention_bias", True, "OLMo Hybrid's attention has no biases")
    sizes = decoder_sizes(config, where, max_seq_len=65536)
    key_heads = _count(config, "linear_num_key_heads", sizes["n_heads"], where)
    value_heads = _count(config, "linear_num_value_heads", sizes["n_heads"], where)
    if value_heads % key_heads:
        raise refuse(
            where, "linear_num_value_heads", value_heads, f"it must be a multiple of linear_num_key_heads={key_heads}"
        )
    key_dim = _count(config, "linear_key_head_dim", int(0.75 * sizes["dim"] / key_heads), where)
    allow_neg_eigval = config.get("linear_allow_neg_eigval", True)
    if not isinstance(allow_neg_eigval, bool):
        raise refuse(where, "linear_allow_neg_eigval", allow_neg_eigval, "it must be true or false")
    rope, rope_theta = _rope(config, where)
    return OlmoHybridArgs(
        **sizes,
        rope_theta=rope_theta,
        rope=rope,
        layer_types=_layer_types(config, where, sizes["n_layers"]),
        linear_key_heads=key_heads,
        linear_value_heads=value_heads,
        linear_key_dim=key_dim,
        linear_value_dim=_count(config, "linear_value_head_dim", 2 * key_dim, where),
        conv_size=_count(config, "linear_conv_kernel_dim", 4, where),
        allow_neg_eigval=allow_neg_eigval,
    )


def write(args: OlmoHybridArgs) -> dict:
    """The olmo_hybrid config.json fields of this model (rope_theta null where it does not rotate)."""
    return {
        **decoder_fields(args, "OlmoHybridForCausalLM", MODEL_TYPE, ("hidden_act", ACTIVATION)),
        "layer_types": list(args.layer_types),
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta if args.rope else None},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "linear_num_key_heads": args.linear_key_heads,
        "linear_num_value_heads": args.linear_value_heads,
        "linear_key_head_dim": args.linear_key_dim,
        "linear_value_head_dim": args.linear_value_dim,
        "linear_conv_kernel_dim": args.conv_size,
        "linear_allow_neg_eigval": args.allow_neg_eigval,
    }
