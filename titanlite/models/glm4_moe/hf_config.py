"""GLM-4.5's config.json (model_type glm4_moe, Glm4MoeForCausalLM: GLM-4.5, GLM-4.5-Air, GLM-4.6) both ways,
torch-free. An absent key takes Glm4MoeConfig's default (a null one too, where transformers' reader would).

Honoured: the decoder's sizes (hidden_size, intermediate_size for the dense layers, num_hidden_layers,
num_attention_heads, num_key_value_heads, head_dim, vocab_size, max_position_embeddings, rms_norm_eps,
tie_word_embeddings), attention_bias (biases on q_proj, k_proj and v_proj; o_proj has none), use_qk_norm (per-head
RMSNorms of queries and keys), partial_rotary_factor (top level, or in rope_parameters), rope_theta and rope_scaling /
rope_parameters (plain or "yarn"), n_routed_experts (num_local_experts), num_experts_per_tok, moe_intermediate_size,
n_shared_experts, routed_scaling_factor, norm_topk_prob, n_group, topk_group, first_k_dense_replace.
Refused in one line naming the field: hidden_act other than silu, mlp_bias, a sliding window, use_qk_norm that is not
true or false, a partial_rotary_factor giving an odd or empty rotary width, RoPE types other than plain and "yarn",
first_k_dense_replace beyond the layers, what MoEArgs refuses (more experts per token than experts, groups that do
not divide the experts or hold the choices). The published FP8 folders' blocks are dequantized as they are read
(titanlite/components/hf_quantized.py). Multi-token prediction (num_nextn_predict_layers, or num_mtp_layers) is
honoured: mtp_layers, those layers (model.layers.N past num_hidden_layers) loaded and trained where the folder holds
them (titanlite/models/hf_config.py held_mtp_layers; model.mtp_layers = 0 leaves them out and carries them unchanged
into an export: titanlite/models/glm4_moe/weights.py).
Ignored, as they change no math: initializer_range, use_cache, output_router_logits, attention_dropout (0; a training
run refuses another value), the token ids (bos, eos, pad), dtype / torch_dtype, transformers_version."""

from __future__ import annotations

import logging

from titanlite.base.errors import ConfigError
from titanlite.base.hf_config import WHOLE, FieldTypes, refuse
from titanlite.models.common.decoder_args import window_of
from titanlite.models.common.decoder_config import (
    attention_shape,
    decoder_fields,
    full_attention,
    no_mlp_bias,
    partial_rotary_dim,
    partial_rotary_factor,
    rope_scaling_to_hf,
    rope_settings,
    rotary_dim_unsaid,
)
from titanlite.models.common.moe.args import MoEArgs
from titanlite.models.common.moe.hf_config import BIAS_ROUTED_FIELDS, MOE_FIELDS, bias_routed_config, block_from_config
from titanlite.models.common.rope_args import YarnRopeScaling
from titanlite.models.glm4_moe.args import Glm4MoeArgs

logger = logging.getLogger(__name__)

# The config.json fields GLM-4.5 reads beyond the shared ones (titanlite/base/hf_config.py FIELDS): the experts' and
# their routing (DeepSeek-V3's), multi-token prediction's.
FIELDS: FieldTypes = {
    **MOE_FIELDS,
    **BIAS_ROUTED_FIELDS,
    "num_nextn_predict_layers": (WHOLE, True),
    "num_mtp_layers": (WHOLE, True),
}

MODEL_TYPE = "glm4_moe"
ARCHITECTURE = "Glm4MoeForCausalLM"
# Glm4MoeConfig's defaults (transformers 5), which an absent (or null) key takes.
DEFAULTS: dict = {
    "vocab_size": 151552,
    "hidden_size": 4096,
    "intermediate_size": 10944,
    "num_hidden_layers": 46,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "use_qk_norm": False,
    "moe_intermediate_size": 1408,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "n_routed_experts": 128,
    "routed_scaling_factor": 1.0,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "partial_rotary_factor": 0.5,
}


def _with_defaults(config: dict) -> dict:
    out = {**DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    if "n_routed_experts" not in config and config.get("num_local_experts") is not None:
        out["n_routed_experts"] = config["num_local_experts"]  # transformers' alias
    return out


def mtp_layers(config: dict) -> int:
    return config.get("num_nextn_predict_layers", config.get("num_mtp_layers", 0)) or 0


def _rotary_dim(config: dict, where: str, head_dim: int) -> int:
    """head_dim x partial_rotary_factor (transformers 5 keeps it in rope_parameters, 4.x at the top level)."""
    rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    return partial_rotary_dim(rope.get("partial_rotary_factor", config["partial_rotary_factor"]), head_dim, where)


def _moe(config: dict, where: str, n_layers: int) -> MoEArgs:
    dense = config["first_k_dense_replace"]
    if dense > n_layers:
        raise refuse(where, "first_k_dense_replace", dense, f"the model has {n_layers} layers")
    experts_key = "n_routed_experts" if "n_routed_experts" in config or "num_local_experts" not in config else (
        "num_local_experts")  # fmt: skip
    return block_from_config(
        where,
        config,
        {"n_experts": experts_key},
        n_experts=config["n_routed_experts"],
        top_k=config["num_experts_per_tok"],
        expert_dim=config["moe_intermediate_size"],
        score_func="sigmoid",
        norm_topk_prob=bool(config["norm_topk_prob"]),
        route_scale=float(config["routed_scaling_factor"]),
        n_shared_experts=config["n_shared_experts"],
        balance="bias",
        n_groups=config["n_group"],
        topk_groups=config["topk_group"],
        dense_layers=tuple(range(dense)),
    )


def read(config: dict, where: str) -> Glm4MoeArgs:
    """Glm4MoeArgs of a glm4_moe config.json."""
    full = _with_defaults(config)
    if full["hidden_act"] != "silu":
        raise refuse(where, "hidden_act", full["hidden_act"], "GLM-4.5's MLPs and experts are SwiGLU (silu)")
    no_mlp_bias("glm4_moe", config, where)
    full_attention(config, where, "glm4_moe")
    if not isinstance(full["use_qk_norm"], bool):
        raise refuse(where, "use_qk_norm", full["use_qk_norm"], "write true or false")
    dim, n_heads, n_kv_heads, head_dim = attention_shape(full, where)
    rope_theta, rope_scaling = rope_settings(full, where)
    if rope_scaling is not None and not isinstance(rope_scaling, YarnRopeScaling):
        raise refuse(where, "rope_type", "llama3", "GLM-4.5 reads plain RoPE or 'yarn'")
    n_layers = full["num_hidden_layers"]
    rotary_dim, moe = _rotary_dim(full, where, head_dim), _moe(full, where, n_layers)
    try:
        args = Glm4MoeArgs(
            dim=dim,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            ffn_dim=full["intermediate_size"],
            vocab_size=full["vocab_size"],
            max_seq_len=full["max_position_embeddings"],
            rope_theta=rope_theta,
            norm_eps=full["rms_norm_eps"],
            tie_embeddings=bool(full["tie_word_embeddings"]),
            head_dim=head_dim,
            rope_scaling=rope_scaling,
            qkv_bias=bool(full["attention_bias"]),
            qk_norm="head" if full["use_qk_norm"] else "none",
            rotary_dim=rotary_dim,
            moe=moe,
            mtp_layers=mtp_layers(config),  # the folder's weights may hold fewer (held_mtp_layers)
        )
    except ValueError as e:  # a check of the arguments' own that no refusal above made in config.json's words
        raise ConfigError(f"{where} is not supported: {e}") from e
    return args


def _unsaid(args: Glm4MoeArgs) -> tuple[str, ...]:
    """What a glm4_moe config.json cannot say of the decoder (transformers' Glm4Moe would compute another model)."""
    problems = []
    if args.out_bias or args.mlp_bias:
        problems.append(f"out_bias={args.out_bias}, mlp_bias={args.mlp_bias} (only q, k and v have biases)")
    if args.qk_norm not in ("none", "head"):
        problems.append(f"qk_norm={args.qk_norm!r}")
    if args.norm_position != "pre":
        problems.append(f"norm_position={args.norm_position!r}")
    if args.nope_layers:
        problems.append(f"nope_layers={list(args.nope_layers)}")
    if any(window_of(args, i) is not None for i in range(args.n_layers)):
        problems.append(f"sliding_window={args.sliding_window}")
    if args.rope_scaling is not None and not isinstance(args.rope_scaling, YarnRopeScaling):
        problems.append("rope_scaling of Llama 3.1")
    unsaid = rotary_dim_unsaid(args)
    if unsaid:
        problems.append(unsaid)
    return tuple(problems)


def write(args: Glm4MoeArgs) -> dict:
    """GLM-4.5's config.json; what it cannot say is refused in one line naming the field: the decoder's switches
    it has no key for, a block other than DeepSeek's (moe/hf_config.py bias_routed_config), dense layers other than
    the first ones."""
    moe = bias_routed_config(args.moe, "glm4_moe", more=_unsaid(args))
    rope = rope_scaling_to_hf(args.rope_scaling)
    factor = partial_rotary_factor(args)
    return {
        **decoder_fields(args, ARCHITECTURE, MODEL_TYPE),
        # transformers 5 reads rope_parameters; 4.x the top-level rope_theta, partial_rotary_factor and rope_scaling.
        "rope_parameters": {"rope_theta": args.rope_theta, "partial_rotary_factor": factor, **rope},
        "rope_theta": args.rope_theta,
        "partial_rotary_factor": factor,
        "rope_scaling": rope if args.rope_scaling else None,
        "attention_bias": args.qkv_bias,
        "attention_dropout": 0.0,
        "use_qk_norm": args.qk_norm == "head",
        **moe,
        "num_nextn_predict_layers": args.mtp_layers,
    }
