"""Kimi Linear (KimiLinearForCausalLM): Kimi Delta Attention (linear attention with a per-channel decay) at three
layers of four, multi-head latent attention without rotary positions at the fourth, a mixture of experts with
sigmoid scores, a balancing bias and a shared expert, the first layer dense. Its sizes (a tiny debug model and
Kimi-Linear-48B-A3B's shape), config.json both ways and its spec."""

from __future__ import annotations

from titanlite.models.kimi_linear import args, hf_config
from titanlite.models.spec import HFConfig, ModelSpec

SPEC = ModelSpec(
    name="kimi_linear",
    args_type=args.KimiLinearArgs,
    flavors=args.FLAVORS,
    model="titanlite.models.kimi_linear.model:KimiLinear",
    tp_plan="titanlite.models.kimi_linear.parallelize:tp_plan",
    hf_weights="titanlite.models.kimi_linear.weights",
    tp_split_sizes=args.split_sizes,
    hf=HFConfig(hf_config.MODEL_TYPE, hf_config.read, hf_config.write, experts=True),
    moe=lambda a: a.moe,
    with_depth=args.with_depth,
    flops="titanlite.models.common.flops:moe_flops_per_token",
    auxiliary_losses=args.auxiliary_losses,
    description="Kimi Linear: Kimi Delta Attention (per-channel decay) at 3 of 4 layers, latent attention without "
    "positions at the 4th, sigmoid-routed experts with a balancing bias and a shared expert, the first layer dense",
)
