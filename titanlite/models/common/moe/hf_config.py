"""The MoE decoder's config.json helpers, torch-free: the JSON types of the mixture-of-experts fields the families
share (MOE_FIELDS, and the groups some of them read: QWEN_MOE_FIELDS, BIAS_ROUTED_FIELDS), its arguments from a
family's Llama decoder fields and MoE block (`with_moe`, `block_from_config`), and what a family's config.json cannot
say about the block (`check_expressible`)."""

from __future__ import annotations

import dataclasses
import re

from titanlite.base.errors import ConfigError
from titanlite.base.hf_config import COUNT, FLAG, NONNEGATIVE, POSITIVE, WHOLE, WHOLES, FieldTypes
from titanlite.models.common.decoder_args import DecoderArgs, MoEDecoderArgs
from titanlite.models.common.moe.args import MoEArgs

# The config.json fields of a mixture of experts, under the names most families' folders give them (check_types'
# table, titanlite/base/hf_config.py): the experts' count (one name or another), how many a token takes, their
# width, the renormalisation and the auxiliary loss. Every family with experts reads them.
MOE_FIELDS: FieldTypes = {
    "num_experts": (WHOLE, True),
    "num_local_experts": (WHOLE, True),
    "n_routed_experts": (WHOLE, True),
    "num_experts_per_tok": (COUNT, False),
    "moe_intermediate_size": (COUNT, False),
    "norm_topk_prob": (FLAG, False),
    "router_aux_loss_coef": (NONNEGATIVE, False),
}
# Qwen's (Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next): the gated shared expert's width, which layers are sparse.
QWEN_MOE_FIELDS: FieldTypes = {
    "shared_expert_intermediate_size": (WHOLE, True),
    "decoder_sparse_step": (COUNT, False),
    "mlp_only_layers": (WHOLES, True),
}
# DeepSeek-V3's routing, which GLM-4.5 and Kimi Linear share (bias_routed_config): shared experts, the routed
# weights' scale, expert groups, the dense layers before the first sparse one.
BIAS_ROUTED_FIELDS: FieldTypes = {
    "n_shared_experts": (WHOLE, True),
    "routed_scaling_factor": (POSITIVE, False),
    "n_group": (COUNT, True),
    "topk_group": (COUNT, True),
    "first_k_dense_replace": (WHOLE, True),
}


def with_moe(base: DecoderArgs, moe: MoEArgs) -> MoEDecoderArgs:
    """The MoE decoder of a config.json: its Llama decoder's arguments and its block's."""
    return MoEDecoderArgs(**{f.name: getattr(base, f.name) for f in dataclasses.fields(DecoderArgs)}, moe=moe)


# MoEArgs' fields -> the config.json keys that set them in most families (a family names its own where they differ).
CONFIG_KEYS = {
    "top_k": "num_experts_per_tok",
    "expert_dim": "moe_intermediate_size",
    "aux_loss_coef": "router_aux_loss_coef",
    "route_scale": "routed_scaling_factor",
    "n_shared_experts": "n_shared_experts",
    "n_groups": "n_group",
    "topk_groups": "topk_group",
}


def block_from_config(where: str, config: dict, keys: dict[str, str], **fields) -> MoEArgs:
    """MoEArgs(**fields), a value it refuses refused in one line in config.json's own names: CONFIG_KEYS updated by
    the family's `keys` (at least "n_experts", the key its folder counts the experts with)."""
    names = CONFIG_KEYS | keys
    check_top_k(where, config, names["n_experts"], fields["top_k"], fields["n_experts"])
    try:
        return MoEArgs(**fields)
    except ValueError as e:
        raise ConfigError(f"{where} is not supported: {in_config_names(str(e), names)}") from e


def in_config_names(message: str, names: dict[str, str]) -> str:
    """An arguments class's refusal ("MoEArgs.top_k=0; ...", "... exceeds n_experts=8") in config.json's names."""
    pattern = r"\b(?:\w+Args\.)?(" + "|".join(map(re.escape, names)) + r")\b"
    return re.sub(pattern, lambda m: names[m.group(1)], message)


def check_top_k(where: str, config: dict, experts_key: str, top_k: int, n_experts: int) -> None:
    """Refuse more experts per token than the block has (top-k of n needs k <= n), in config.json's names."""
    if top_k > n_experts:
        default = "" if "num_experts_per_tok" in config else " (the default: config.json does not set it)"
        raise ConfigError(
            f"{where} num_experts_per_tok={top_k}{default} exceeds {experts_key}={n_experts}: each token is routed "
            f"to num_experts_per_tok distinct experts; set num_experts_per_tok to at most {n_experts}"
        )


# What a Hugging Face MoE config.json of the softmax-routed families fixes about the block (field: its value).
FIXED = {
    "score_func": "softmax",
    "route_scale": 1.0,
    "router_bias": False,
    "n_shared_experts": 0,
    "shared_expert_dim": 0,
    "shared_gate": False,
    "z_loss_coef": 0.0,
    "n_groups": 1,
}


# The experts' shape every family's config.json but Nemotron-H's and DeepSeek-V4's fixes: SwiGLU experts in the
# model's width, unclamped, every block routed by its scores (no hash-routed layers).
SWIGLU_EXPERTS = {"activation": "swiglu", "latent_dim": 0, "swiglu_limit": 0.0, "hash_layers": ()}


def check_expressible(
    moe: MoEArgs,
    family: str,
    dense_layers: bool = True,
    fixed: dict | None = None,
    bias_balance: bool = False,
    more: tuple[str, ...] = (),
) -> None:
    """What a family's config.json cannot say about the MoE block is refused, naming the field: the fields it
    fixes (`fixed`, FIXED by default; the experts' activation and width SWIGLU_EXPERTS unless `fixed` says), the bias
    balancing unless it stores the biases (`bias_balance`), dense
    layers unless it names them, and the family's own `more` problems."""
    problems = [
        f"MoEArgs.{name}={getattr(moe, name)!r}"
        for name, value in {**SWIGLU_EXPERTS, **(fixed or FIXED)}.items()
        if getattr(moe, name) != value
    ]
    if moe.balance == "bias" and not bias_balance:
        problems.append("moe.balance='bias' (routing biases choose its experts; without them it would route otherwise)")
    if moe.dense_layers and not dense_layers:
        problems.append(f"MoEArgs.dense_layers={list(moe.dense_layers)}")
    problems += more
    if problems:
        raise ConfigError(f"a {family} config.json cannot express {', '.join(problems)}")


# A bias_routed block's (moe/args.py) config.json keys as DeepSeek-V3 and GLM-4.5 name them: MoEArgs field -> key.
BIAS_ROUTED_KEYS = {
    "n_experts": "n_routed_experts",
    "top_k": "num_experts_per_tok",
    "expert_dim": "moe_intermediate_size",
    "n_shared_experts": "n_shared_experts",
    "route_scale": "routed_scaling_factor",
    "norm_topk_prob": "norm_topk_prob",
    "n_groups": "n_group",
    "topk_groups": "topk_group",
}


def bias_routed_config(
    moe: MoEArgs, family: str, keys: dict[str, str] = BIAS_ROUTED_KEYS, first_dense: bool = True, more: tuple = ()
) -> dict:
    """The config.json fields of a DeepSeek-style block (moe/args.py bias_routed: sigmoid scores, stored routing
    biases, groups, shared experts of the routed experts' width) under `keys`, and with `first_dense` its dense layers
    as first_k_dense_replace (leading ones only). What the family's config.json cannot say is refused in one line
    naming the field, with the family's own `more` problems."""
    problems = list(more)
    if first_dense and moe.dense_layers != tuple(range(len(moe.dense_layers))):
        problems.append(f"MoEArgs.dense_layers={list(moe.dense_layers)} (only the first layers can be dense)")
    check_expressible(
        moe,
        family,
        fixed={"score_func": "sigmoid", "router_bias": False, "shared_expert_dim": 0, "shared_gate": False},
        bias_balance=True,
        more=tuple(problems),
    )
    fields = {key: getattr(moe, name) for name, key in keys.items()}
    return fields | ({"first_k_dense_replace": len(moe.dense_layers)} if first_dense else {})
