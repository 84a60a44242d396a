"""Qwen3-MoE's config.json (model_type qwen3_moe) both ways, torch-free: Qwen3's decoder fields (the Llama
decoder's, per-head Q/K norms) plus the mixture-of-experts fields, each honoured or refused in one line:
num_experts (transformers 5 writes num_local_experts), num_experts_per_tok, moe_intermediate_size,
norm_topk_prob, router_aux_loss_coef, decoder_sparse_step and mlp_only_layers (the dense layers). Ignored, as
they change no math: output_router_logits (whether transformers returns the router logits) and max_window_layers.
Qwen3-MoE has no shared expert: a shared_expert_intermediate_size is refused."""

from __future__ import annotations

import dataclasses

from titanlite.base.errors import ConfigError
from titanlite.base.hf_config import refuse
from titanlite.models.common.moe_args import MoEArgs, dense_layers_from_hf
from titanlite.models.llama3.args import LlamaArgs
from titanlite.models.llama3.hf_config import (
    DecoderConfig,
    Expressible,
    attention_biases,
    no_mlp_bias,
    unwindowed_fields,
    window_if_used,
)
from titanlite.models.qwen3_moe.args import MoEDecoderArgs


def _switches(config: dict, n_layers: int, where: str) -> dict:
    no_mlp_bias("qwen3_moe", config, where)
    return attention_biases(config, n_layers, where) | {"qk_norm": "head"}


DECODER = DecoderConfig(
    family="qwen3_moe",
    model_type="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    expressible=Expressible(mlp_bias=False, qk_norm="head"),
    switches=_switches,
    window=window_if_used,
    fields=unwindowed_fields,
)


def moe_from_config(config: dict, n_layers: int, where: str) -> MoEArgs:
    """The MoE block of a qwen3_moe config.json (absent keys take Qwen3MoeConfig's defaults)."""
    n_experts = config.get("num_experts", config.get("num_local_experts", 128))
    if not n_experts or n_experts < 1:
        raise refuse(where, "num_experts", n_experts, "a model without experts is a qwen3 model (model_type qwen3)")
    if config.get("shared_expert_intermediate_size"):
        raise refuse(
            where,
            "shared_expert_intermediate_size",
            config["shared_expert_intermediate_size"],
            "qwen3_moe has no shared expert",
        )
    try:
        dense = dense_layers_from_hf(
            n_layers, config.get("mlp_only_layers") or [], config.get("decoder_sparse_step", 1)
        )
        return MoEArgs(
            n_experts=n_experts,
            top_k=config.get("num_experts_per_tok", 8),
            expert_dim=config.get("moe_intermediate_size", 768),
            norm_topk_prob=bool(config.get("norm_topk_prob", False)),
            aux_loss_coef=config.get("router_aux_loss_coef", 0.001),
            dense_layers=dense,
        )
    except ValueError as e:
        raise ConfigError(f"{where} is not supported: {e}") from e


def read(config: dict, where: str) -> MoEDecoderArgs:
    base = DECODER.read(config, where)
    return with_moe(base, moe_from_config(config, base.n_layers, where))


def with_moe(base: LlamaArgs, moe: MoEArgs) -> MoEDecoderArgs:
    """The MoE decoder of a config.json: its Llama decoder's arguments and its block's."""
    return MoEDecoderArgs(**{f.name: getattr(base, f.name) for f in dataclasses.fields(LlamaArgs)}, moe=moe)


def block_from_config(where: str, **fields) -> MoEArgs:
    """MoEArgs(**fields), a field it refuses (top_k above n_experts, ...) refused in one line naming where."""
    try:
        return MoEArgs(**fields)
    except ValueError as e:
        raise ConfigError(f"{where} is not supported: {e}") from e


def check_expressible(moe: MoEArgs, family: str = "qwen3_moe", dense_layers: bool = True) -> None:
    """What a family's config.json cannot say about the MoE block is refused, naming the field."""
    problems = [
        f"MoEArgs.{name}={getattr(moe, name)!r}"
        for name, default in (
            ("score_func", "softmax"),
            ("route_scale", 1.0),
            ("router_bias", False),
            ("n_shared_experts", 0),
            ("shared_expert_dim", 0),
            ("shared_gate", False),
            ("z_loss_coef", 0.0),
        )
        if getattr(moe, name) != default
    ]
    if moe.balance == "bias":
        problems.append("MoEArgs.balance='bias'")
    if moe.dense_layers and not dense_layers:
        problems.append(f"MoEArgs.dense_layers={list(moe.dense_layers)}")
    if problems:
        raise ConfigError(f"a {family} config.json cannot express {', '.join(problems)}")


def write(args: MoEDecoderArgs) -> dict:
    moe = args.moe
    check_expressible(moe)
    return DECODER.write(args) | {
        "num_experts": moe.n_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.expert_dim,
        "norm_topk_prob": moe.norm_topk_prob,
        "router_aux_loss_coef": moe.aux_loss_coef if moe.balance == "aux_loss" else 0.0,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(moe.dense_layers),
        "output_router_logits": False,
    }
