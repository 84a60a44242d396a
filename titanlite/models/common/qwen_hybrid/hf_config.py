"""The Qwen hybrid decoder's config.json both ways, torch-free: Qwen3.5's text model's fields (model_type
"qwen3_5_text", Qwen3_5ForCausalLM; "qwen3_5_moe_text" with mixtures of experts), which Qwen3-Next's extend, and the
multimodal folders' as published ("qwen3_5" / "qwen3_5_moe", Qwen3_5ForConditionalGeneration), whose text_config is
read. Every field that changes the text model's math is honoured or refused in one line naming it."""

from __future__ import annotations

from titanlite.base.errors import ConfigError
from titanlite.base.hf_config import COUNT, OBJECT, WHOLE, FieldTypes, refuse
from titanlite.models.common.decoder_config import (
    attention_shape,
    decoder_fields,
    partial_rotary_dim,
    partial_rotary_factor,
    rotary_dim_unsaid,
)
from titanlite.models.common.linear_attention_args import GATED_DELTA_NET_FIELDS, LAYER_KINDS, hybrid_layers
from titanlite.models.common.moe.hf_config import MOE_FIELDS, QWEN_MOE_FIELDS, block_from_config
from titanlite.models.common.qwen_hybrid.args import QwenHybridArgs, QwenHybridMoEArgs

# The config.json fields the Qwen hybrids read beyond the shared ones (titanlite/base/hf_config.py FIELDS): the
# linear layers' (GatedDeltaNetArgs'), their interval, multi-token prediction's, a multimodal folder's text_config;
# EXPERT_FIELDS with the mixtures of experts' (Qwen3.5-MoE, Qwen3-Next).
FIELDS: FieldTypes = {
    **GATED_DELTA_NET_FIELDS,
    "moe_intermediate_size": (COUNT, False),  # the dense reader's MLP width where intermediate_size is absent
    "full_attention_interval": (COUNT, False),
    "mtp_num_hidden_layers": (WHOLE, True),
    "num_nextn_predict_layers": (WHOLE, True),
    "text_config": (OBJECT, False),
}
EXPERT_FIELDS: FieldTypes = {**FIELDS, **MOE_FIELDS, **QWEN_MOE_FIELDS}

TEXT, MOE_TEXT = "qwen3_5_text", "qwen3_5_moe_text"
MULTIMODAL = {"qwen3_5": TEXT, "qwen3_5_moe": MOE_TEXT}  # a published folder's model_type -> its text model's
ACTIVATION = "silu"


def text_config(config: dict, where: str) -> tuple[dict, str]:
    """The text model's fields (a multimodal folder's text_config) and where they are, for the refusals."""
    if config.get("model_type") in MULTIMODAL:
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise refuse(where, "text_config", text, "a multimodal config.json holds the text model there")
        return {"tie_word_embeddings": config.get("tie_word_embeddings", False), **text}, f"{where} text_config"
    return config, where


def _rope(config: dict, where: str, head_dim: int) -> tuple[float, int]:
    """rope_theta and the rotating channels of each head (head_dim x partial_rotary_factor). The multimodal
    rotations (mrope_section) turn text positions as plain RoPE does: accepted, and nothing more."""
    rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type != "default":
        why = "the hybrid decoder's rotations are the default ones"
        raise refuse(where, "rope_parameters rope_type", rope_type, why)
    factor = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))
    rotary_dim = partial_rotary_dim(factor, head_dim, where)
    return float(rope.get("rope_theta", config.get("rope_theta", 1e7))), rotary_dim


def read_fields(config: dict, where: str) -> dict:
    """The fields of QwenHybridArgs a (text) config.json sets."""
    for key in ("hidden_act",):
        if config.get(key, ACTIVATION) != ACTIVATION:
            raise refuse(where, key, config[key], f"the hybrid decoder's MLP and convolutions use {ACTIVATION!r}")
    if config.get("attention_bias"):
        raise refuse(where, "attention_bias", True, "the hybrid decoder's attention has no biases")
    dim, n_heads, n_kv_heads, head_dim = attention_shape(config, where)
    n_layers = config["num_hidden_layers"]
    kinds = tuple(config.get("layer_types") or ()) or hybrid_layers(n_layers, config.get("full_attention_interval", 4))
    unknown = sorted(set(kinds) - set(LAYER_KINDS))
    if unknown:
        raise refuse(where, "layer_types", unknown[0], f"the hybrid decoder's layers are {' or '.join(LAYER_KINDS)}")
    if len(kinds) != n_layers:
        raise refuse(where, "layer_types", f"[{len(kinds)} entries]", f"it needs one per layer ({n_layers})")
    key_heads, value_heads = config.get("linear_num_key_heads", 16), config.get("linear_num_value_heads", 32)
    if value_heads % key_heads:
        raise refuse(
            where, "linear_num_value_heads", value_heads, f"it must be a multiple of linear_num_key_heads={key_heads}"
        )
    conv = config.get("linear_conv_kernel_dim", 4)
    if conv < 1:
        raise refuse(where, "linear_conv_kernel_dim", conv, "the convolution needs a width of at least 1")
    rope_theta, rotary_dim = _rope(config, where, head_dim)
    return {
        "dim": dim,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "n_kv_heads": n_kv_heads,
        "ffn_dim": config.get("intermediate_size") or config.get("moe_intermediate_size"),
        "vocab_size": config["vocab_size"],
        "max_seq_len": config.get("max_position_embeddings", 262144),
        "rope_theta": rope_theta,
        "norm_eps": config.get("rms_norm_eps", 1e-6),
        "tie_embeddings": config.get("tie_word_embeddings", False),
        "head_dim": head_dim,
        "layer_types": kinds,
        "rotary_dim": rotary_dim,
        "linear_key_heads": key_heads,
        "linear_value_heads": value_heads,
        "linear_key_dim": config.get("linear_key_head_dim", 128),
        "linear_value_dim": config.get("linear_value_head_dim", 128),
        "conv_size": conv,
        # what the folder's weights hold may be less (models/hf_config.py held_mtp_layers)
        "mtp_layers": config.get("mtp_num_hidden_layers", config.get("num_nextn_predict_layers", 0)) or 0,
    }


def read(config: dict, where: str, cls: type[QwenHybridArgs]) -> QwenHybridArgs:
    """`cls` (a family's QwenHybridArgs) of a text config.json, or of a multimodal one's text_config."""
    text, where = text_config(config, where)
    return cls(**read_fields(text, where))


def read_moe(config: dict, where: str, cls: type[QwenHybridMoEArgs]) -> QwenHybridMoEArgs:
    """`cls` (a family's QwenHybridMoEArgs) of a qwen3_5_moe_text config.json, or of a qwen3_5_moe (multimodal) one's
    text_config: every layer a mixture of experts, top-k renormalised, a gated shared expert."""
    text, where = text_config(config, where)
    fields = read_fields(text, where)
    for key in ("mlp_only_layers",):
        if text.get(key):
            raise refuse(where, key, text[key], "every Qwen3.5-MoE layer is a mixture of experts")
    expert_dim = text["moe_intermediate_size"]
    moe = block_from_config(
        where,
        text,
        {"n_experts": "num_experts", "shared_expert_dim": "shared_expert_intermediate_size"},
        n_experts=text["num_experts"],
        top_k=text.get("num_experts_per_tok", 8),
        expert_dim=expert_dim,
        norm_topk_prob=True,
        shared_expert_dim=text.get("shared_expert_intermediate_size", expert_dim),
        shared_gate=True,
        aux_loss_coef=text.get("router_aux_loss_coef", 0.001),
    )
    return cls(**fields | {"ffn_dim": expert_dim}, moe=moe)


def write_fields(args: QwenHybridArgs, architecture: str, model_type: str, omit: tuple[str, ...] = ()) -> dict:
    """The text config.json fields of the hybrid decoder, under the family's `architecture` and `model_type` (`omit`:
    the shared fields its config.json does not hold, decoder_config.decoder_fields')."""
    unsaid = rotary_dim_unsaid(args)
    if unsaid:
        raise ConfigError(f"a {args.family} config.json cannot express {unsaid}")
    return {
        **decoder_fields(args, architecture, model_type, ("hidden_act", ACTIVATION), omit),
        "layer_types": list(args.layer_types),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": args.rope_theta,
            "partial_rotary_factor": partial_rotary_factor(args),
        },
        "attention_bias": False,
        "attention_dropout": 0.0,
        "linear_conv_kernel_dim": args.conv_size,
        "linear_key_head_dim": args.linear_key_dim,
        "linear_value_head_dim": args.linear_value_dim,
        "linear_num_key_heads": args.linear_key_heads,
        "linear_num_value_heads": args.linear_value_heads,
    } | ({"mtp_num_hidden_layers": args.mtp_layers} if args.mtp_layers else {})


def write(args: QwenHybridArgs) -> dict:
    """The qwen3_5_text (or, for QwenHybridMoEArgs, qwen3_5_moe_text) config.json fields of this model."""
    if not isinstance(args, QwenHybridMoEArgs):
        return write_fields(args, "Qwen3_5ForCausalLM", TEXT)
    # the experts' width is moe_intermediate_size; no MLP is dense
    config = write_fields(args, "Qwen3_5MoeForCausalLM", MOE_TEXT, omit=("intermediate_size",))
    m = args.moe
    if m.dense_layers or not m.norm_topk_prob or not m.shared_gate or m.score_func != "softmax":
        raise refuse(
            "a qwen3_5_moe config.json", "moe", m, "Qwen3.5-MoE routes every layer by softmax, top-k renormalised, "
            "with one gated shared expert",
        )  # fmt: skip
    return config | {
        "num_experts": m.n_experts,
        "num_experts_per_tok": m.top_k,
        "moe_intermediate_size": m.expert_dim,
        "shared_expert_intermediate_size": m.shared_hidden,
        "router_aux_loss_coef": m.aux_loss_coef,
    }
