"""Kimi Linear (KimiLinearForCausalLM): Kimi Delta Attention (linear attention with a per-channel decay) at three
layers of four, multi-head latent attention without rotary positions at the fourth, a mixture of experts with
sigmoid scores, a balancing bias and a shared expert, the first layer dense. Its sizes (a tiny debug model and
Kimi-Linear-48B-A3B's shape), config.json both ways and its spec."""

from __future__ import annotations

from titanlite.models.common.decoder_spec import moe_decoder_spec
from titanlite.models.kimi_linear import args, hf_config

SPEC = moe_decoder_spec(
    "kimi_linear",
    args.FLAVORS,
    hf_config.read,
    hf_config.write,
    "titanlite.models.kimi_linear.weights",
    "Kimi Linear: Kimi Delta Attention (per-channel decay) at 3 of 4 layers, latent attention without positions at "
    "the 4th, sigmoid-routed experts with a balancing bias and a shared expert, the first layer dense",
    args_type=args.KimiLinearArgs,
    model="titanlite.models.kimi_linear.model:KimiLinear",
    tp_plan="titanlite.models.kimi_linear.parallelize:tp_plan",
    tp_split_sizes=args.split_sizes,
    with_depth=args.with_depth,
    fields=hf_config.FIELDS,
)
