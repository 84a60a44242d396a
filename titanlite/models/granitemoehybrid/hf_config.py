"""Granite 4.0 H's config.json both ways (model_type "granitemoehybrid", GraniteMoeHybridForCausalLM), torch-free.
The layers come from `layer_types` under its published names ("mamba", "attention") or transformers' own
("linear_attention", "full_attention"; `layers_block_type` too). An absent key takes GraniteMoeHybridConfig's default;
every field that changes the math is honoured or refused in one line naming it.

The Mamba layers' step is clamped to time_step_limit (transformers' default: none); their projections' biases follow
mamba_proj_bias, the convolution's mamba_conv_bias, their gated norm is grouped by mamba_n_groups. transformers'
experts and shared MLP have no biases, whatever mlp_bias says, and its attention no sliding window: a config.json
asking for either is refused."""

from __future__ import annotations

import math

from titanlite.base.errors import ConfigError
from titanlite.base.hf_config import COUNT, NONNEGATIVE, NUMBER, TEXT, TEXTS, WHOLE, FieldTypes, refuse
from titanlite.models.common.decoder_config import rope_scaling_to_hf, rope_settings
from titanlite.models.common.mamba2_args import MAMBA_FIELDS, step_limit, step_limit_fields
from titanlite.models.common.moe.args import MoEArgs
from titanlite.models.common.moe.hf_config import FIXED, block_from_config, check_expressible
from titanlite.models.granitemoehybrid.args import GraniteMoeHybridArgs

MODEL_TYPE, ARCHITECTURE = "granitemoehybrid", "GraniteMoeHybridForCausalLM"
# layer_types' names, published and transformers' -> ours; and ours -> the published ones, which an export writes
HF_KINDS = {"mamba": "mamba", "linear_attention": "mamba", "attention": "full_attention", "full_attention":
            "full_attention"}  # fmt: skip
PUBLISHED_KINDS = {"mamba": "mamba", "full_attention": "attention"}
POSITIONS = {None: False, "nope": False, "rope": True}  # position_embedding_type -> whether attention rotates
FIELDS: FieldTypes = {
    "layers_block_type": (TEXTS, True),
    "embedding_multiplier": (NUMBER, False),
    "attention_multiplier": (NUMBER, False),
    "residual_multiplier": (NUMBER, False),
    "logits_scaling": (NUMBER, False),
    "num_local_experts": (WHOLE, False),
    "num_experts_per_tok": (WHOLE, False),
    "router_aux_loss_coef": (NONNEGATIVE, True),
    "shared_intermediate_size": (COUNT, False),
    "position_embedding_type": (TEXT, True),
    **MAMBA_FIELDS,
}
# GraniteMoeHybridConfig's defaults (transformers 5) of what a config.json may leave out
DEFAULTS = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "embedding_multiplier": 1.0,
    "logits_scaling": 1.0,
    "residual_multiplier": 1.0,
    "attention_multiplier": 1.0,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "router_aux_loss_coef": 0.001,
    "shared_intermediate_size": 1024,
    "mamba_n_heads": 128,
    "mamba_n_groups": 1,
    "mamba_d_state": 256,
    "mamba_d_head": "auto",
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 256,
    "mamba_conv_bias": True,
    "mamba_proj_bias": False,
    "time_step_limit": (0.0, math.inf),
}
# config.json's names of the MoE block's fields that Granite names its own way
MOE_KEYS = {"n_experts": "num_local_experts", "expert_dim": "intermediate_size", "shared_expert_dim":
            "shared_intermediate_size"}  # fmt: skip


def _layer_types(config: dict, n_layers: int, where: str) -> tuple[str, ...]:
    """The layers, from layer_types (or layers_block_type, transformers' other name for it); every layer Mamba-2
    where neither is given (transformers' default)."""
    key = "layer_types" if config.get("layer_types") is not None else "layers_block_type"
    kinds = config.get(key)
    if kinds is None:
        return ("mamba",) * n_layers
    for kind in kinds:
        if kind not in HF_KINDS:
            raise refuse(where, key, kind, f"Granite 4.0 H's layer kinds are {', '.join(HF_KINDS)}")
    if len(kinds) != n_layers:
        raise refuse(where, "num_hidden_layers", n_layers, f"{key} names {len(kinds)} layers")
    return tuple(HF_KINDS[kind] for kind in kinds)


def _mamba_head_dim(c: dict, dim: int, where: str) -> int:
    """The Mamba heads' width: mamba_d_head, or "auto" (transformers' default) the inner width int(mamba_expand x
    hidden_size) over mamba_n_heads; their product must be that inner width either way."""
    heads, inner, head_dim = c["mamba_n_heads"], int(c["mamba_expand"] * dim), c["mamba_d_head"]
    if head_dim == "auto":
        if inner % heads:
            raise refuse(where, "mamba_n_heads", heads, f"it must divide mamba_expand x hidden_size = {inner}")
        return inner // heads
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
        raise refuse(where, "mamba_d_head", head_dim, 'it is a whole number of at least 1, or "auto"')
    if head_dim * heads != inner:
        raise refuse(where, "mamba_d_head", head_dim, f"mamba_n_heads={heads} heads of it must make the inner width "
                     f"mamba_expand x hidden_size = {inner}")  # fmt: skip
    return head_dim


def _moe(config: dict, c: dict, where: str) -> MoEArgs | None:
    """The experts beside the shared MLP (None: num_local_experts 0): a softmax over the top num_experts_per_tok
    router logits (the top k of a softmax, renormalised), SwiGLU experts of width intermediate_size."""
    if not c["num_local_experts"]:
        return None
    return block_from_config(
        where,
        config,
        MOE_KEYS,
        n_experts=c["num_local_experts"],
        top_k=c["num_experts_per_tok"],
        expert_dim=c["intermediate_size"],
        norm_topk_prob=True,
        shared_expert_dim=c["shared_intermediate_size"],
        aux_loss_coef=c["router_aux_loss_coef"] or 0.0,
    )


def _refuse_unbuilt(c: dict, where: str) -> None:
    """What transformers' GraniteMoeHybrid never computes, though a config.json may ask for it."""
    if c["hidden_act"] != "silu":
        raise refuse(where, "hidden_act", c["hidden_act"], "titanlite builds Granite 4.0 H's SwiGLU experts, shared "
                     "MLP and Mamba convolution with 'silu'")  # fmt: skip
    if c.get("mlp_bias"):
        raise refuse(where, "mlp_bias", True, "transformers' Granite 4.0 H experts and shared MLP have no biases")
    if c.get("sliding_window") is not None:
        raise refuse(where, "sliding_window", c["sliding_window"], "Granite 4.0 H's attention sees the whole sequence")
    if c.get("position_embedding_type") not in POSITIONS:
        raise refuse(where, "position_embedding_type", c["position_embedding_type"], "it is 'rope', 'nope' or null")
    if POSITIONS[c.get("position_embedding_type")] and c.get("partial_rotary_factor") not in (None, 1, 1.0):
        raise refuse(where, "partial_rotary_factor", c["partial_rotary_factor"], "titanlite rotates Granite 4.0 H's "
                     "whole heads, as transformers' default rotation does")  # fmt: skip
    if not c["logits_scaling"]:
        raise refuse(where, "logits_scaling", c["logits_scaling"], "the logits are divided by it")


def read(config: dict, where: str) -> GraniteMoeHybridArgs:
    """GraniteMoeHybridArgs of a granitemoehybrid config.json."""
    c = {**DEFAULTS, **config}
    _refuse_unbuilt(c, where)
    dim, n_heads = c["hidden_size"], c["num_attention_heads"]
    n_kv_heads = c.get("num_key_value_heads") or n_heads
    if n_heads % n_kv_heads:
        raise refuse(where, "num_key_value_heads", n_kv_heads, f"it must divide num_attention_heads={n_heads}")
    rope = POSITIONS[c.get("position_embedding_type")]
    head_dim = c.get("head_dim") or dim // n_heads
    if rope and head_dim % 2:
        raise refuse(where, "head_dim", head_dim, "RoPE rotates pairs, so it must be even")
    rope_theta, rope_scaling = rope_settings(config, where) if rope else (10000.0, None)
    mamba_heads, groups = c["mamba_n_heads"], c["mamba_n_groups"]
    if mamba_heads % groups:
        raise refuse(where, "mamba_n_groups", groups, f"it must divide mamba_n_heads={mamba_heads}")
    dt_min, dt_max = step_limit(c["time_step_limit"], where)
    bias = bool(c["attention_bias"])
    return GraniteMoeHybridArgs(
        dim=dim,
        n_layers=c["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        ffn_dim=c["shared_intermediate_size"],
        vocab_size=c["vocab_size"],
        max_seq_len=c["max_position_embeddings"],
        norm_eps=c["rms_norm_eps"],
        tie_embeddings=c["tie_word_embeddings"],
        qkv_bias=bias,
        out_bias=bias,
        rope=rope,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        layer_types=_layer_types(config, c["num_hidden_layers"], where),
        mamba_heads=mamba_heads,
        mamba_head_dim=_mamba_head_dim(c, dim, where),
        mamba_groups=groups,
        state_dim=c["mamba_d_state"],
        conv_size=c["mamba_d_conv"],
        conv_bias=c["mamba_conv_bias"],
        mamba_bias=c["mamba_proj_bias"],
        dt_min=dt_min,
        dt_max=dt_max,
        mamba_chunk_size=c["mamba_chunk_size"],
        embedding_multiplier=float(c["embedding_multiplier"]),
        attention_multiplier=float(c["attention_multiplier"]),
        residual_multiplier=float(c["residual_multiplier"]),
        logits_scaling=float(c["logits_scaling"]),
        moe=_moe(config, c, where),
    )


def _moe_fields(args: GraniteMoeHybridArgs) -> dict:
    """The experts' config.json fields (num_local_experts 0, as Granite 4.0 H Micro's, without them)."""
    moe = args.moe
    if moe is None:
        return {"num_local_experts": 0, "num_experts_per_tok": 0, "intermediate_size": args.ffn_dim,
                "router_aux_loss_coef": 0.0}  # fmt: skip
    more = () if moe.norm_topk_prob else ("MoEArgs.norm_topk_prob=False (it renormalises the top k always)",)
    fixed = {k: v for k, v in FIXED.items() if k != "shared_expert_dim"}
    check_expressible(moe, MODEL_TYPE, dense_layers=False, fixed=fixed, more=more)
    return {
        "num_local_experts": moe.n_experts,
        "num_experts_per_tok": moe.top_k,
        "intermediate_size": moe.expert_dim,
        "router_aux_loss_coef": moe.aux_loss_coef if moe.balance == "aux_loss" else 0.0,
    }


def write(args: GraniteMoeHybridArgs) -> dict:
    """The granitemoehybrid config.json fields of this model, its layers under their published names."""
    if args.mamba_width % args.dim:
        raise ConfigError(
            f"a {MODEL_TYPE} config.json cannot express a Mamba inner width {args.mamba_width} that is not a multiple "
            f"of the model width {args.dim} (mamba_expand x hidden_size)"
        )
    limit = step_limit_fields(args.dt_min, args.dt_max)
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "hidden_size": args.dim,
        "shared_intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "layer_types": [PUBLISHED_KINDS[kind] for kind in args.layer_types],
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "attention_bias": args.qkv_bias,
        "attention_dropout": 0.0,
        "position_embedding_type": "rope" if args.rope else "nope",
        # transformers 5 reads rope_parameters; 4.x the top-level rope_theta and rope_scaling.
        "rope_theta": args.rope_theta,
        "rope_parameters": {"rope_theta": args.rope_theta, **rope_scaling_to_hf(args.rope_scaling)},
        "rope_scaling": rope_scaling_to_hf(args.rope_scaling) if args.rope_scaling else None,
        "embedding_multiplier": args.embedding_multiplier,
        "attention_multiplier": args.attention_multiplier,
        "residual_multiplier": args.residual_multiplier,
        "logits_scaling": args.logits_scaling,
        **_moe_fields(args),
        "output_router_logits": False,
        "mamba_n_heads": args.mamba_heads,
        "mamba_d_head": args.mamba_head_dim,
        "mamba_n_groups": args.mamba_groups,
        "mamba_d_state": args.state_dim,
        "mamba_d_conv": args.conv_size,
        "mamba_expand": args.mamba_width // args.dim,
        "mamba_chunk_size": args.mamba_chunk_size,
        "mamba_conv_bias": args.conv_bias,
        "mamba_proj_bias": args.mamba_bias,
        **limit,
    }
