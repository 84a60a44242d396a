"""Nemotron-H's config.json both ways (model_type "nemotron_h", NemotronHForCausalLM), torch-free. The layers come
from `layers_block_type` (transformers' names) or the published `hybrid_override_pattern` ("M", "*", "-"); the
mixer's fields under transformers' names or the published mamba_* ones. An absent key takes NemotronHConfig's
default; every field that changes the math is honoured or refused in one line naming it.

transformers' mixer clamps the step below at time_step_min and reads no time_step_limit; nor do we. Its attention has
no biases whatever attention_bias says, its Mamba projections' biases follow use_bias (not mamba_proj_bias), and its
lm_head is never tied to the embeddings: a config.json asking for either bias or for tying is refused, as
transformers would build a model without it. Multi-token prediction (num_nextn_predict_layers, Nemotron 3 Super's one
depth of attention then MoE) is built and trained where the folder holds its mtp.* tensors; transformers builds
none."""

from __future__ import annotations

import math

from titanlite.base.hf_config import COUNT, FLAG, NONNEGATIVE, POSITIVE, TEXT, TEXTS, WHOLE, FieldTypes, refuse
from titanlite.models.common.moe.args import MoEArgs
from titanlite.models.common.moe.hf_config import BIAS_ROUTED_FIELDS, MOE_FIELDS, block_from_config
from titanlite.models.nemotron_h.args import NemotronHArgs, layers_of, pattern_of

MODEL_TYPE, ARCHITECTURE = "nemotron_h", "NemotronHForCausalLM"
MTP_PATTERN = "*E"  # a multi-token prediction depth: attention, then the mixture of experts
# transformers' layers_block_type names -> ours
HF_KINDS = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "full_attention", "attention":
            "full_attention", "mlp": "mlp", "moe": "moe"}  # fmt: skip
# The mixer's fields under their published names (mamba_*) -> transformers' (it reads both)
ALIASES = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_dt_min": "time_step_min",
    "mamba_dt_max": "time_step_max",
    "mamba_dt_init_floor": "time_step_floor",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_chunk_size": "chunk_size",
}
FIELDS: FieldTypes = {
    **MOE_FIELDS,
    **BIAS_ROUTED_FIELDS,
    "moe_shared_expert_intermediate_size": (COUNT, False),
    "moe_latent_size": (COUNT, True),
    "layers_block_type": (TEXTS, True),
    "hybrid_override_pattern": (TEXT, True),
    "layer_norm_epsilon": (NONNEGATIVE, False),
    "mlp_hidden_act": (TEXT, False),
    "mamba_hidden_act": (TEXT, False),
    "mamba_num_heads": (COUNT, False),
    "mamba_head_dim": (COUNT, False),
    "ssm_state_size": (COUNT, False),
    "n_groups": (COUNT, False),
    "conv_kernel": (COUNT, False),
    "use_conv_bias": (FLAG, False),
    "use_bias": (FLAG, False),
    "mamba_proj_bias": (FLAG, False),
    "chunk_size": (COUNT, False),
    "time_step_min": (NONNEGATIVE, False),
    "time_step_max": (POSITIVE, False),
    "time_step_floor": (NONNEGATIVE, False),
    "num_nextn_predict_layers": (WHOLE, False),
    "mtp_layers_block_type": (TEXTS, True),
    "mtp_hybrid_override_pattern": (TEXT, True),
    **{alias: (kind, False) for alias, kind in (
        ("mamba_n_groups", COUNT), ("mamba_d_conv", COUNT), ("mamba_dt_min", NONNEGATIVE), ("mamba_dt_max", POSITIVE),
        ("mamba_dt_init_floor", NONNEGATIVE), ("mamba_conv_bias", FLAG), ("mamba_chunk_size", COUNT))},
}  # fmt: skip
# NemotronHConfig's defaults (transformers 5) of what a config.json may leave out
DEFAULTS = {
    "vocab_size": 131072,
    "hidden_size": 4096,
    "intermediate_size": 21504,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 4096,
    "layer_norm_epsilon": 1e-5,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "ssm_state_size": 128,
    "n_groups": 8,
    "conv_kernel": 4,
    "use_conv_bias": True,
    "use_bias": False,
    "chunk_size": 128,
    "time_step_min": 0.001,
    "time_step_max": 0.1,
    "time_step_floor": 1e-4,
    "tie_word_embeddings": False,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 7688,
    "moe_shared_expert_intermediate_size": 7688,
    "routed_scaling_factor": 1.0,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
}
# Our MoEArgs fields -> the config.json keys that set them (block_from_config's refusals name these)
MOE_KEYS = {
    "n_experts": "n_routed_experts",
    "expert_dim": "moe_intermediate_size",
    "shared_expert_dim": "moe_shared_expert_intermediate_size",
    "latent_dim": "moe_latent_size",
}


def _layer_types(config: dict, where: str) -> tuple[str, ...]:
    """The layers, from layers_block_type (transformers' names) or hybrid_override_pattern (the published
    characters), the first where both are given (as transformers reads them)."""
    kinds = config.get("layers_block_type")
    if kinds is None and config.get("layer_types") is not None:
        kinds = config["layer_types"]
    if kinds is not None:
        for kind in kinds:
            if kind not in HF_KINDS:
                known = ", ".join(sorted(HF_KINDS))
                raise refuse(where, "layers_block_type", kind, f"Nemotron-H's layer kinds are {known}")
        layers = tuple(HF_KINDS[kind] for kind in kinds)
    else:
        pattern = config.get("hybrid_override_pattern", "ME*-")  # transformers' default when neither is given
        try:
            layers = layers_of(pattern)
        except ValueError as e:
            raise refuse(where, "hybrid_override_pattern", pattern, str(e)) from None
    declared = config.get("num_hidden_layers")
    if declared is not None and declared != len(layers):
        raise refuse(where, "num_hidden_layers", declared, f"the layer pattern has {len(layers)} layers")
    if not layers:
        raise refuse(where, "hybrid_override_pattern", "", "Nemotron-H needs at least one layer")
    return layers


def read(config: dict, where: str) -> NemotronHArgs:
    """NemotronHArgs of a nemotron_h config.json."""
    c = {**DEFAULTS, **{ALIASES.get(key, key): value for key, value in config.items()}}
    for key, value, must in (
        ("mlp_hidden_act", c.get("mlp_hidden_act", "relu2"), "relu2"),
        ("mamba_hidden_act", c.get("mamba_hidden_act", "silu"), "silu"),
    ):
        if value != must:
            raise refuse(where, key, value, f"transformers' Nemotron-H uses {must!r} there")
    for key, why in (
        ("attention_bias", "transformers' Nemotron-H attention has no biases"),
        ("mamba_proj_bias", "transformers' Nemotron-H reads use_bias for the Mamba projections"),
        ("tie_word_embeddings", "transformers' Nemotron-H keeps lm_head apart from the embeddings whatever it says"),
    ):
        if c.get(key):
            raise refuse(where, key, True, why)
    if c.get("sliding_window") is not None:
        raise refuse(where, "sliding_window", c["sliding_window"], "Nemotron-H's attention sees the whole sequence")
    mtp = _mtp_layers(c, where)
    layers = _layer_types(config, where)
    heads, groups = c["mamba_num_heads"], c["n_groups"]
    if heads % groups:
        raise refuse(where, "mamba_num_heads", heads, f"it must be a multiple of n_groups={groups}")
    if c["time_step_min"] >= math.inf or c["time_step_max"] <= 0:
        raise refuse(where, "time_step_min", c["time_step_min"], "the step's lower clamp must be finite")
    moe = _moe(c, where) if "moe" in layers else None
    if moe is not None and c.get("mlp_bias"):
        raise refuse(where, "mlp_bias", True, "titanlite's shared expert has no biases; Nemotron-H's MoE layers' does")
    return NemotronHArgs(
        dim=c["hidden_size"],
        n_layers=len(layers),
        n_heads=c["num_attention_heads"],
        n_kv_heads=c["num_key_value_heads"] or c["num_attention_heads"],
        head_dim=c["head_dim"],
        ffn_dim=c["intermediate_size"],
        vocab_size=c["vocab_size"],
        max_seq_len=c["max_position_embeddings"],
        norm_eps=c["layer_norm_epsilon"],
        tie_embeddings=False,
        mlp_bias=c.get("mlp_bias", False),
        layer_types=layers,
        mamba_heads=heads,
        mamba_head_dim=c["mamba_head_dim"],
        mamba_groups=groups,
        state_dim=c["ssm_state_size"],
        conv_size=c["conv_kernel"],
        conv_bias=c["use_conv_bias"],
        mamba_bias=c["use_bias"],
        dt_min=c["time_step_min"],
        mamba_chunk_size=c["chunk_size"],
        dt_init_min=c["time_step_min"],
        dt_init_max=c["time_step_max"],
        dt_init_floor=c["time_step_floor"],
        moe=moe,
        mtp_layers=mtp,
    )


def _mtp_layers(c: dict, where: str) -> int:
    """num_nextn_predict_layers (0 or 1: Nemotron 3 Super's one depth), whose block must be attention then the
    mixture of experts (mtp_layers_block_type, or the published mtp_hybrid_override_pattern "*E")."""
    mtp = c.get("num_nextn_predict_layers") or 0
    if not mtp:
        return 0
    if mtp != 1:
        raise refuse(where, "num_nextn_predict_layers", mtp, "Nemotron's multi-token prediction has one depth")
    kinds = c.get("mtp_layers_block_type")
    if kinds is None and c.get("mtp_hybrid_override_pattern") is not None:
        pattern = c["mtp_hybrid_override_pattern"]
        if pattern != MTP_PATTERN:
            raise refuse(where, "mtp_hybrid_override_pattern", pattern, f"titanlite builds a depth of {MTP_PATTERN!r}")
    elif kinds is not None and [HF_KINDS.get(kind) for kind in kinds] != ["full_attention", "moe"]:
        raise refuse(where, "mtp_layers_block_type", kinds, "titanlite builds a depth of attention, then MoE")
    return mtp


def _moe(c: dict, where: str) -> MoEArgs:
    """The "moe" layers' block: relu^2 experts without gates (and a shared one of
    moe_shared_expert_intermediate_size, which transformers builds whatever n_shared_experts says), sigmoid scores
    with the stored routing biases (e_score_correction_bias) choosing, group-limited routing, the chosen weights
    renormalised (norm_topk_prob) and scaled (routed_scaling_factor), the experts in moe_latent_size where it is set."""
    fields = dict(
        n_experts=c["n_routed_experts"],
        top_k=c["num_experts_per_tok"],
        expert_dim=c["moe_intermediate_size"],
        score_func="sigmoid",
        norm_topk_prob=c["norm_topk_prob"],
        route_scale=c["routed_scaling_factor"],
        shared_expert_dim=c["moe_shared_expert_intermediate_size"],
        balance="bias",
        n_groups=c["n_group"] or 1,
        topk_groups=c["topk_group"] or 1,
        activation="relu2",
        latent_dim=c.get("moe_latent_size") or 0,
    )
    return block_from_config(where, c, MOE_KEYS, **fields)


def write(args: NemotronHArgs) -> dict:
    """The nemotron_h config.json fields of this model, its layers as the published hybrid_override_pattern."""
    if (
        args.dt_max != math.inf
        or args.dt_min != args.dt_init_min
        or args.mamba_norm_groups != args.mamba_groups
        or args.tie_embeddings
    ):
        raise ValueError("a nemotron_h config.json says no upper step clamp, the lower one at time_step_min, the "
                         "output norm over n_groups slices and an lm_head of its own")  # fmt: skip
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "hybrid_override_pattern": pattern_of(args.layer_types),
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "layer_norm_epsilon": args.norm_eps,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": args.mlp_bias,
        "mlp_hidden_act": "relu2",
        "mamba_hidden_act": "silu",
        "mamba_num_heads": args.mamba_heads,
        "mamba_head_dim": args.mamba_head_dim,
        "n_groups": args.mamba_groups,
        "ssm_state_size": args.state_dim,
        "conv_kernel": args.conv_size,
        "use_conv_bias": args.conv_bias,
        "use_bias": args.mamba_bias,
        "chunk_size": args.mamba_chunk_size,
        "time_step_min": args.dt_min,
        "time_step_max": args.dt_init_max,
        "time_step_floor": args.dt_init_floor,
        **({"expand": args.mamba_width // args.dim} if args.mamba_width % args.dim == 0 else {}),  # read by no code
        "num_nextn_predict_layers": args.mtp_layers,
        **({"mtp_hybrid_override_pattern": MTP_PATTERN} if args.mtp_layers else {}),
        **(_moe_fields(args.moe) if args.moe is not None else {}),
    }


def _moe_fields(moe: MoEArgs) -> dict:
    """The "moe" layers' config.json fields; what a nemotron_h config.json cannot say refused in one line."""
    fixed = {"score_func": "sigmoid", "router_bias": False, "shared_gate": False, "n_shared_experts": 0,
             "activation": "relu2", "z_loss_coef": 0.0}  # fmt: skip
    problems = [f"MoEArgs.{name}={getattr(moe, name)!r}" for name, want in fixed.items() if getattr(moe, name) != want]
    if not moe.shared_expert_dim:
        problems.append("no shared expert (transformers' Nemotron-H always has one)")
    if problems:
        raise ValueError(f"a nemotron_h config.json cannot express {', '.join(problems)}")
    return {
        "n_routed_experts": moe.n_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.expert_dim,
        "moe_shared_expert_intermediate_size": moe.shared_expert_dim,
        "moe_latent_size": moe.latent_dim or None,
        "n_shared_experts": 1,
        "routed_scaling_factor": moe.route_scale,
        "n_group": moe.n_groups,
        "topk_group": moe.topk_groups,
        "norm_topk_prob": moe.norm_topk_prob,
    }
