"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's decoder whose feed-forward is a mixture of experts (softmax router,
top-k, optionally renormalised, no shared expert), with transformers' load-balancing loss. Its spec, and
`moe_decoder_spec`, with which the families that reuse this MoE decoder (OLMoE, Mixtral) describe themselves."""

from __future__ import annotations

from collections.abc import Callable

from titanlite.models.qwen3_moe import args, hf_config
from titanlite.models.spec import HFConfig, ModelSpec


def moe_decoder_spec(
    name: str, flavors: dict, read: Callable, write: Callable, hf_weights: str, description: str
) -> ModelSpec:
    """The spec of a family built by the MoE decoder: its module, plan and FLOPs are this folder's."""
    return ModelSpec(
        name=name,
        args_type=args.MoEDecoderArgs,
        flavors=flavors,
        model="titanlite.models.qwen3_moe.model:MoEDecoder",
        tp_plan="titanlite.models.qwen3_moe.parallelize:tp_plan",
        hf_weights=hf_weights,
        tp_split_sizes=args.split_sizes,
        hf=HFConfig(name, read, write, experts=True),
        tp_refusal=args.tp_refusal,
        with_depth=args.with_depth,
        flops="titanlite.models.common.flops:moe_flops_per_token",
        auxiliary_losses=args.auxiliary_losses,
        description=description,
    )


SPEC = moe_decoder_spec(
    "qwen3_moe", args.FLAVORS, hf_config.read, hf_config.write, "titanlite.models.qwen3_moe.weights",
    "Qwen3-MoE: Qwen3's decoder with mixture-of-experts feed-forwards (top-k of softmax, no shared expert)",
)  # fmt: skip
