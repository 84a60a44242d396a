"""Kimi Linear's config.json (model_type kimi_linear, KimiLinearForCausalLM) both ways, torch-free. Every field that
changes the math is honoured or refused in one line naming it.

Read in transformers' names and in the published checkpoint's (the names in brackets; transformers maps them the
same way): the decoder's sizes, layer_types (or linear_attn_config's 1-based kda_layers and full_attn_layers; absent
both, transformers' default: latent attention at every fourth layer from the fifth), mlp_layer_types (or
first_k_dense_replace, default 1), linear_head_dim, linear_num_heads and linear_conv_kernel_dim (or
linear_attn_config's head_dim, num_heads, short_conv_kernel_size), the latent attention's q_lora_rank (null: one
q_proj), kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim (kept, not rotated), v_head_dim, and the experts:
num_local_experts [num_experts], num_experts_per_tok [num_experts_per_token], moe_intermediate_size,
n_shared_experts [num_shared_experts], routed_scaling_factor, norm_topk_prob [moe_renormalize], n_group
[num_expert_group], topk_group. Refused: a layer kind other than linear_attention / full_attention, an MLP kind other
than dense / sparse, a num_key_value_heads other than the heads, attention_bias, hidden_act other than silu,
mla_use_nope false (rotary latent attention, which transformers' KimiLinear does not build), a router activation
(moe_router_activation_func) other than sigmoid, moe_layer_freq other than 1, and in linear_attn_config the variants
of KDA that transformers' KimiLinear does not compute: a bounded decay (gate_lower_bound), a full-rank forget gate
(use_full_rank_gate), grouped value heads (num_v_heads), expanded values (expand_v), negative eigenvalues
(allow_neg_eigval), no short convolution (use_short_conv false), 0-based layer lists (kda_layer_index_base).
Ignored, as they change no math: rope_theta and rope_scaling (nothing is rotated), use_grouped_topk (n_group
decides), head_dim, output_router_logits, pretraining_tp, initializer_range, attention_dropout (0), use_cache."""

from __future__ import annotations

from titanlite.base.errors import ConfigError
from titanlite.base.hf_config import COUNT, FLAG, OBJECT, TEXT, TEXTS, WHOLE, FieldTypes, refuse
from titanlite.models.common.decoder_config import decoder_fields
from titanlite.models.common.latent.hf_config import (
    LATENT_FIELDS,
    LATENT_KEYS,
    LATENT_OMITS,
    latent_from_config,
    latent_to_config,
)
from titanlite.models.common.linear_attention_args import LAYER_KINDS
from titanlite.models.common.moe.args import MoEArgs
from titanlite.models.common.moe.hf_config import (
    BIAS_ROUTED_FIELDS,
    MOE_FIELDS,
    bias_routed_config,
    block_from_config,
    in_config_names,
)
from titanlite.models.kimi_linear.args import KimiLinearArgs

MODEL_TYPE = "kimi_linear"
ARCHITECTURE = "KimiLinearForCausalLM"
# The config.json fields Kimi Linear reads beyond the shared ones (titanlite/base/hf_config.py FIELDS): the experts'
# and their routing (DeepSeek-V3's), latent attention's, and its own: transformers' names, then those of the
# published checkpoint that mean the same.
FIELDS: FieldTypes = {
    **MOE_FIELDS,
    **BIAS_ROUTED_FIELDS,
    **LATENT_FIELDS,
    "moe_layer_freq": (COUNT, False),
    "mlp_layer_types": (TEXTS, True),
    "linear_attn_config": (OBJECT, True),
    "linear_num_heads": (COUNT, False),
    "linear_head_dim": (COUNT, False),
    "linear_conv_kernel_dim": (COUNT, False),
    "mla_use_nope": (FLAG, True),
    "moe_router_activation_func": (TEXT, True),
    "num_experts_per_token": (COUNT, False),
    "num_shared_experts": (WHOLE, True),
    "moe_renormalize": (FLAG, False),
    "num_expert_group": (COUNT, True),
    "model_max_length": (COUNT, False),
}

MLP_KINDS = ("dense", "sparse")
# linear_attn_config's keys for KDA variants transformers' KimiLinear does not compute: key -> (the value it
# computes, what another value would be).
_KDA_VARIANTS = {
    "gate_lower_bound": (None, "a decay bounded below (GLM-5's forget gate); KDA's is -exp(A_log) softplus(.)"),
    "use_full_rank_gate": (False, "a full-rank forget gate; KDA's is low-rank (f_a_proj, f_b_proj)"),
    "expand_v": (1, "values wider than the keys; KDA's heads have one width"),
    "allow_neg_eigval": (False, "a write strength of 2 sigmoid(b); KDA's is sigmoid(b)"),
    "use_short_conv": (True, "no short convolution; KDA convolves q, k and v"),
    "kda_layer_index_base": (1, "0-based layer lists; transformers reads kda_layers and full_attn_layers 1-based"),
}


def _get(config: dict, names: tuple[str, ...], default):
    """The first of `names` config.json sets (transformers' name, then the published checkpoint's), else default."""
    for name in names:
        if config.get(name) is not None:
            return config[name]
    return default


def _layer_types(config: dict, where: str, n_layers: int) -> tuple[str, ...]:
    linear = config.get("linear_attn_config") or {}
    kinds = config.get("layer_types")
    if kinds is None and "kda_layers" in linear and "full_attn_layers" in linear:
        by_layer: list = [None] * n_layers
        for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
            for layer in linear[key]:
                if not isinstance(layer, int) or not 1 <= layer <= n_layers:
                    raise refuse(where, f"linear_attn_config.{key}", linear[key], f"use layers 1 to {n_layers}")
                by_layer[layer - 1] = kind
        if None in by_layer:
            raise ConfigError(
                f"{where} linear_attn_config is not supported: layer {by_layer.index(None) + 1} of {n_layers} is in "
                "neither kda_layers nor full_attn_layers"
            )
        kinds = by_layer
    if kinds is None:  # transformers' default: latent attention at layers 4, 8, ... (0-based)
        return tuple("full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n_layers))
    unknown = [k for k in kinds if k not in LAYER_KINDS]
    if unknown:
        raise refuse(where, "layer_types", unknown[0], f"Kimi Linear's layers are {' or '.join(LAYER_KINDS)}")
    if len(kinds) != n_layers:
        raise refuse(where, "layer_types", f"{len(kinds)} entries", f"num_hidden_layers is {n_layers}")
    return tuple(kinds)


def _dense_layers(config: dict, where: str, n_layers: int) -> tuple[int, ...]:
    kinds = config.get("mlp_layer_types")
    if kinds is None:
        first = config.get("first_k_dense_replace", 1) or 0
        return tuple(range(min(first, n_layers)))
    unknown = [k for k in kinds if k not in MLP_KINDS]
    if unknown:
        raise refuse(where, "mlp_layer_types", unknown[0], f"use {' or '.join(MLP_KINDS)}")
    if len(kinds) != n_layers:
        raise refuse(where, "mlp_layer_types", f"{len(kinds)} entries", f"num_hidden_layers is {n_layers}")
    return tuple(i for i, kind in enumerate(kinds) if kind == "dense")


def _check_linear(config: dict, where: str) -> dict:
    linear = config.get("linear_attn_config") or {}
    if not isinstance(linear, dict):
        raise refuse(where, "linear_attn_config", linear, "it must be a JSON object")
    for key, (computed, other) in _KDA_VARIANTS.items():
        if key in linear and linear[key] != computed:
            raise refuse(where, f"linear_attn_config.{key}", linear[key], other)
    heads = _get(config, ("linear_num_heads",), linear.get("num_heads", 32))
    if "num_v_heads" in linear and linear["num_v_heads"] != heads:
        raise refuse(
            where, "linear_attn_config.num_v_heads", linear["num_v_heads"],
            f"KDA's value heads are its num_heads={heads} (no grouped heads)",
        )  # fmt: skip
    conv = _get(config, ("linear_conv_kernel_dim",), linear.get("short_conv_kernel_size", 4))
    if not isinstance(conv, int) or isinstance(conv, bool) or conv < 1:
        key = "linear_conv_kernel_dim" if "linear_conv_kernel_dim" in config else "short_conv_kernel_size"
        raise refuse(where, key, conv, "the short convolution's width is a whole number of tokens, at least 1")
    return {
        "linear_heads": heads,
        "linear_head_dim": _get(config, ("linear_head_dim",), linear.get("head_dim", 128)),
        "conv_size": conv,
    }


def _attention(config: dict, where: str) -> dict:
    """The heads and the latent attention's fields (latent/hf_config.py), refusing what Kimi Linear's do not compute."""
    n_heads = config.get("num_attention_heads", 32)
    latent = latent_from_config(config, where, "Kimi Linear", n_heads)
    if config.get("mla_use_nope") is False:
        raise refuse(where, "mla_use_nope", False, "Kimi Linear's latent attention rotates nothing")
    if config.get("hidden_act", "silu") != "silu":
        raise refuse(where, "hidden_act", config["hidden_act"], "the MLPs are SwiGLU and KDA's convolution SiLU")
    return {"n_heads": n_heads, **latent}


def _moe(config: dict, where: str, dense_layers: tuple[int, ...]) -> MoEArgs:
    activation = config.get("moe_router_activation_func", "sigmoid")
    if activation != "sigmoid":
        raise refuse(where, "moe_router_activation_func", activation, "transformers' KimiLinear scores by sigmoid")
    if config.get("moe_layer_freq", 1) != 1:
        raise refuse(where, "moe_layer_freq", config["moe_layer_freq"], "every layer after the dense ones is sparse")
    experts_key = next((k for k in ("num_local_experts", "num_experts") if config.get(k) is not None), "num_experts")
    return block_from_config(
        where,
        config,
        {"n_experts": experts_key},
        n_experts=_get(config, ("num_local_experts", "num_experts"), 256),
        top_k=_get(config, ("num_experts_per_tok", "num_experts_per_token"), 8),
        expert_dim=config.get("moe_intermediate_size", 1024),
        score_func="sigmoid",
        norm_topk_prob=bool(_get(config, ("norm_topk_prob", "moe_renormalize"), True)),
        route_scale=float(config.get("routed_scaling_factor", 2.446)),
        n_shared_experts=_get(config, ("n_shared_experts", "num_shared_experts"), 1),
        balance="bias",
        n_groups=_get(config, ("n_group", "num_expert_group"), 1),
        topk_groups=config.get("topk_group") or 1,
        dense_layers=dense_layers,
    )


# KimiLinearArgs' fields -> their config.json keys, for refusals in config.json's words.
_KEYS = LATENT_KEYS | {
    "linear_heads": "linear_num_heads",
    "linear_head_dim": "linear_head_dim",
    "conv_size": "linear_conv_kernel_dim",
}
# The experts' fields (moe/hf_config.py bias_routed_config) in the published checkpoint's names, which its own code
# (and vLLM) reads; transformers reads them too.
_MOE_KEYS = {
    "n_experts": "num_experts",
    "top_k": "num_experts_per_token",
    "expert_dim": "moe_intermediate_size",
    "n_shared_experts": "num_shared_experts",
    "route_scale": "routed_scaling_factor",
    "norm_topk_prob": "moe_renormalize",
    "n_groups": "num_expert_group",
    "topk_groups": "topk_group",
}


def read(config: dict, where: str) -> KimiLinearArgs:
    """KimiLinearArgs of a kimi_linear config.json (absent keys take KimiLinearConfig's defaults)."""
    n_layers = config.get("num_hidden_layers", 27)
    attention = _attention(config, where)
    linear = _check_linear(config, where)
    layer_types = _layer_types(config, where, n_layers)
    moe = _moe(config, where, _dense_layers(config, where, n_layers))
    try:
        return KimiLinearArgs(
            dim=config.get("hidden_size", 2304),
            n_layers=n_layers,
            ffn_dim=config.get("intermediate_size", 9216),
            layer_types=layer_types,
            vocab_size=config.get("vocab_size", 163840),
            max_seq_len=_get(config, ("max_position_embeddings", "model_max_length"), 1048576),
            norm_eps=config.get("rms_norm_eps", 1e-5),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            moe=moe,
            **attention,
            **linear,
        )
    except ValueError as e:  # the widths' own checks, in config.json's names
        raise ConfigError(f"{where} is not supported: {in_config_names(str(e), _KEYS)}") from e


def write(args: KimiLinearArgs) -> dict:
    """Kimi Linear's config.json; a block other than DeepSeek's (moe/hf_config.py bias_routed_config) is refused,
    naming the field. Any dense layers: mlp_layer_types names them."""
    moe = bias_routed_config(args.moe, "kimi_linear", _MOE_KEYS, first_dense=False)
    kinds = list(args.layer_types)
    return {
        # its context length is model_max_length
        **decoder_fields(args, ARCHITECTURE, MODEL_TYPE, omit=(*LATENT_OMITS, "max_position_embeddings")),
        "model_max_length": args.max_seq_len,
        **latent_to_config(args),
        "mla_use_nope": True,
        "layer_types": kinds,
        "mlp_layer_types": ["sparse" if args.moe.is_sparse(i) else "dense" for i in range(args.n_layers)],
        "linear_head_dim": args.linear_head_dim,
        "linear_num_heads": args.linear_heads,
        "linear_conv_kernel_dim": args.conv_size,
        # The published checkpoint's form of the same, which its own code (and vLLM) reads: 1-based layers.
        "linear_attn_config": {
            "kda_layers": [i + 1 for i, kind in enumerate(kinds) if kind == "linear_attention"],
            "full_attn_layers": [i + 1 for i, kind in enumerate(kinds) if kind == "full_attention"],
            "num_heads": args.linear_heads,
            "head_dim": args.linear_head_dim,
            "short_conv_kernel_size": args.conv_size,
        },
        **moe,
        "moe_router_activation_func": "sigmoid",
    }
