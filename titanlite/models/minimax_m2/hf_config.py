"""MiniMax-M2's config.json (model_type minimax_m2, MiniMaxM2ForCausalLM) both ways, torch-free. Every field that
changes the math is honoured or refused in one line naming it; absent ones take MiniMaxM2Config's defaults.

Honoured: the decoder's sizes (hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
vocab_size, max_position_embeddings, rms_norm_eps, tie_word_embeddings), intermediate_size (each expert's width),
num_local_experts (or num_experts), num_experts_per_tok, router_aux_loss_coef (kept for moe.balance = "aux_loss";
the folder's own balancing is the routing bias), rope_theta / rope_parameters, and the rotating channels of each
head: rotary_dim (the published folders' field) or partial_rotary_factor (transformers', top level or in
rope_parameters), which must agree where both are given.
Refused unless they say what transformers' MiniMaxM2 computes: hidden_act other than silu, attention_bias, mlp_bias,
a sliding window (sliding_window, layer_types), rope_type other than "default", use_qk_norm false or qk_norm_type
other than "per_layer" (the norm is over each token's whole query and key projection), scoring_func other than
"sigmoid", use_routing_bias false (the experts are chosen by score plus e_score_correction_bias),
shared_intermediate_size other than 0 (no shared expert), norm_topk_prob false (the chosen scores are always
renormalised), routed_scaling_factor other than 1, attn_type_list with an entry other than 1 (0 is MiniMax-Text-01's
lightning attention) or not one per layer. quantization_config is the shared reader's (titanlite/base/hf_config.py
quantization_of: fp8 blocks dequantized as they are read); it takes fmt "e4m3", and the published folders write the
same format as "float8_e4m3fn", which it refuses today. Multi-token prediction (use_mtp with num_mtp_modules > 0;
the published folders declare 3 modules but hold none of their weights) is left out: titanlite trains without it,
says so once, does not load a folder's MTP layers and carries them unchanged into an export (weights.py
hf_carried).
Ignored, as they change no math: architectures, auto_map, output_router_logits, initializer_range, use_cache,
attention_dropout and router_jitter_noise (a training run refuses them non-zero), the token ids, dtype,
transformers_version, and mtp_transformer_layers."""

from __future__ import annotations

import dataclasses
import logging

from titanlite.base.errors import ConfigError
from titanlite.base.hf_config import COUNT, FLAG, POSITIVE, TEXT, WHOLE, WHOLES, FieldTypes, refuse
from titanlite.models.common.decoder_args import DecoderArgs
from titanlite.models.common.decoder_config import (
    DecoderConfig,
    Expressible,
    attention_biases,
    no_mlp_bias,
    partial_rotary_factor,
    rotary_dim_unsaid,
)
from titanlite.models.common.moe.hf_config import FIXED, MOE_FIELDS, block_from_config, check_expressible
from titanlite.models.minimax_m2.args import MiniMaxM2Args

logger = logging.getLogger(__name__)

# The config.json fields MiniMax-M2 reads beyond the shared ones (titanlite/base/hf_config.py FIELDS): the experts'
# and their routing, which layers are softmax attention (all, 1), its rotated channels, multi-token prediction.
FIELDS: FieldTypes = {
    **MOE_FIELDS,
    "scoring_func": (TEXT, False),
    "routed_scaling_factor": (POSITIVE, False),
    "attn_type_list": (WHOLES, True),
    "rotary_dim": (COUNT, True),
    "use_mtp": (FLAG, True),
    "num_mtp_modules": (WHOLE, True),
}

MODEL_TYPE = "minimax_m2"
# MiniMaxM2Config's defaults, for the keys the shared reader needs (an absent key reads as transformers reads it).
DEFAULTS = {
    "vocab_size": 200064,
    "hidden_size": 3072,
    "intermediate_size": 1536,
    "num_hidden_layers": 62,
    "num_attention_heads": 48,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 196608,
    "rms_norm_eps": 1e-6,
    "rope_theta": 5e6,
}
# What the config.json says of the routing and norms, and the only value transformers' MiniMaxM2 computes with.
FIXED_FIELDS = {
    "use_qk_norm": (True, "transformers' MiniMaxM2 always normalises the queries and keys"),
    "qk_norm_type": ("per_layer", "the norm is over each token's whole query and key projection"),
    "scoring_func": ("sigmoid", "MiniMax-M2 scores each expert with a sigmoid"),
    "use_routing_bias": (True, "MiniMax-M2 chooses its experts by score plus e_score_correction_bias"),
    "shared_intermediate_size": (0, "MiniMax-M2 has no shared expert"),
    "norm_topk_prob": (True, "MiniMax-M2 always renormalises the chosen experts' scores"),
    "routed_scaling_factor": (1.0, "MiniMax-M2 does not scale the routed experts' weights"),
}
_MTP_TOLD: set[str] = set()  # the config.json files whose multi-token prediction was already named


def _switches(config: dict, n_layers: int, where: str) -> dict:
    no_mlp_bias(MODEL_TYPE, config, where)
    if config.get("attention_bias"):
        raise refuse(where, "attention_bias", config["attention_bias"], "MiniMax-M2's projections have no biases")
    return attention_biases(config, n_layers, where) | {"qk_norm": "full"}


DECODER = DecoderConfig(
    family=MODEL_TYPE,
    model_type=MODEL_TYPE,
    architecture="MiniMaxM2ForCausalLM",
    expressible=Expressible(qkv_bias=False, out_bias=False, mlp_bias=False, qk_norm="full", partial_rotary=True),
    switches=_switches,
)


def _rope_fields(config: dict) -> dict:
    return {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}


def rotary_dim_of(config: dict, head_dim: int, where: str) -> int:
    """The channels of each head that rotate, as transformers derives them: int(head_dim x partial_rotary_factor)
    (in rope_parameters, or at the top level), else rotary_dim, else the whole head. Where two of them are given
    and disagree, the config.json is refused: MiniMax's own code reads rotary_dim, transformers the factor."""
    said: dict[str, tuple[object, int]] = {}  # key -> (its value, the channels it rotates)
    for key, factor in (
        ("rope_parameters.partial_rotary_factor", _rope_fields(config).get("partial_rotary_factor")),
        ("partial_rotary_factor", config.get("partial_rotary_factor")),
    ):
        if factor is not None:
            if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
                raise refuse(where, key, factor, "it is the fraction of each head that rotates, in (0, 1]")
            said[key] = (factor, int(head_dim * factor))
    rotary_dim = config.get("rotary_dim")
    if rotary_dim is not None:
        if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int):
            raise refuse(where, "rotary_dim", rotary_dim, "it is a whole number of channels")
        said["rotary_dim"] = (rotary_dim, rotary_dim)
    if not said:
        return head_dim
    (key, (value, channels)), *others = said.items()
    for other, (other_value, other_channels) in others:
        if other_channels != channels:
            raise refuse(
                where, key, value, f"it rotates {channels} channels of each head where {other}={other_value!r} "
                f"rotates {other_channels}; give one of them, or both agreeing",
            )  # fmt: skip
    if channels % 2 or not 0 < channels <= head_dim:
        raise refuse(where, key, value, f"it must rotate an even number of channels from 2 to head_dim={head_dim}")
    return channels


def _check_fixed(config: dict, where: str) -> None:
    for key, (expected, why) in FIXED_FIELDS.items():
        value = config.get(key)
        if value is not None and (value != expected or isinstance(value, bool) != isinstance(expected, bool)):
            raise refuse(where, key, value, why)
    layers = config.get("attn_type_list")
    if layers is not None:
        n_layers = config.get("num_hidden_layers", DEFAULTS["num_hidden_layers"])
        if not isinstance(layers, list) or len(layers) != n_layers:
            raise refuse(where, "attn_type_list", layers, f"it needs one entry per layer ({n_layers})")
        for i, kind in enumerate(layers):
            if kind != 1 or isinstance(kind, bool):
                raise refuse(
                    where, f"attn_type_list[{i}]", kind, "every MiniMax-M2 layer is softmax attention (1); 0 is "
                    "MiniMax-Text-01's lightning attention, which titanlite does not build",
                )  # fmt: skip
    rope = _rope_fields(config)
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type != "default":
        raise refuse(where, "rope_type", rope_type, "MiniMax-M2 rotates with plain RoPE ('default')")


def _mtp_modules(config: dict, where: str) -> int:
    """How many multi-token prediction modules the config.json declares (0 without use_mtp), named once a file."""
    use, modules = config.get("use_mtp", False), config.get("num_mtp_modules", 0) or 0
    if not isinstance(use, bool):
        raise refuse(where, "use_mtp", use, "it is true or false")
    if isinstance(modules, bool) or not isinstance(modules, int) or modules < 0:
        raise refuse(where, "num_mtp_modules", modules, "it is a whole number of 0 or more")
    if use and modules and where not in _MTP_TOLD:
        _MTP_TOLD.add(where)
        logger.info(
            f"{where} use_mtp with num_mtp_modules={modules}: titanlite trains MiniMax-M2 without multi-token "
            "prediction; a folder's MTP layers (if it holds any) are not loaded, and an export carries them unchanged"
        )
    return modules if use else 0


def read(config: dict, where: str) -> MiniMaxM2Args:
    """MiniMaxM2Args of a minimax_m2 config.json."""
    _check_fixed(config, where)
    _mtp_modules(config, where)
    filled = {**DEFAULTS, **config}
    base = DECODER.read(filled, where)
    rotary_dim = rotary_dim_of(filled, base.head_dim, where)
    experts_key = (
        "num_experts" if "num_experts" in config and "num_local_experts" not in config else "num_local_experts"
    )
    moe = block_from_config(
        where,
        config,
        {"n_experts": experts_key, "expert_dim": "intermediate_size"},
        n_experts=config.get(experts_key, 256),
        top_k=config.get("num_experts_per_tok", 8),
        expert_dim=base.ffn_dim,
        score_func="sigmoid",
        norm_topk_prob=True,
        balance="bias",
        aux_loss_coef=config.get("router_aux_loss_coef", 0.001),
    )
    shared = {f.name: getattr(base, f.name) for f in dataclasses.fields(DecoderArgs)}
    try:
        return MiniMaxM2Args(**shared | {"rotary_dim": rotary_dim}, moe=moe)
    except ValueError as e:
        raise ConfigError(f"{where} is not supported: {e}") from e


def write(args: MiniMaxM2Args) -> dict:
    """The config.json of this model (refused, naming the field, where MiniMaxM2ForCausalLM would compute another)."""
    moe = args.moe
    fixed = {**FIXED, "score_func": "sigmoid", "norm_topk_prob": True}
    more = [f"sliding_window={args.sliding_window}"] if args.sliding_window else []
    unsaid = rotary_dim_unsaid(args)  # transformers reads the factor back as int(head_dim x it)
    if unsaid:
        more.append(unsaid)
    check_expressible(moe, MODEL_TYPE, dense_layers=False, fixed=fixed, bias_balance=True, more=tuple(more))
    config = DECODER.write(args)
    return config | {
        "intermediate_size": moe.expert_dim,
        "rope_parameters": {**config["rope_parameters"], "partial_rotary_factor": partial_rotary_factor(args)},
        "rotary_dim": args.rotary_dim,
        "num_local_experts": moe.n_experts,
        "num_experts_per_tok": moe.top_k,
        "router_aux_loss_coef": moe.aux_loss_coef,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
        "scoring_func": "sigmoid",
        "use_routing_bias": True,
        "use_qk_norm": True,
        "qk_norm_type": "per_layer",
        "shared_intermediate_size": 0,
        "attn_type_list": [1] * args.n_layers,
        "use_mtp": False,
        "num_mtp_modules": 0,
    }
