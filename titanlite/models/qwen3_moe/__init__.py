"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's decoder whose feed-forward is a mixture of experts (softmax router,
top-k, optionally renormalised, no shared expert), with transformers' load-balancing loss. Its spec."""

from __future__ import annotations

from titanlite.models.qwen3_moe import args, hf_config
from titanlite.models.spec import HFConfig, ModelSpec

SPEC = ModelSpec(
    name="qwen3_moe",
    args_type=args.Qwen3MoeArgs,
    flavors=args.FLAVORS,
    model="titanlite.models.qwen3_moe.model:Qwen3Moe",
    tp_plan="titanlite.models.qwen3_moe.parallelize:tp_plan",
    hf_weights="titanlite.models.qwen3_moe.weights",
    tp_split_sizes=args.split_sizes,
    hf=HFConfig("qwen3_moe", hf_config.read, hf_config.write, experts=True),
    tp_refusal=args.tp_refusal,
    with_depth=args.with_depth,
    flops="titanlite.models.common.flops:moe_flops_per_token",
    auxiliary_losses=args.auxiliary_losses,
    description="Qwen3-MoE: Qwen3's decoder with mixture-of-experts feed-forwards (top-k of softmax, no shared expert)",
)
