"""Qwen3.5-MoE (Qwen3_5MoeForCausalLM, and the text model of the published multimodal folders): Qwen3.5's hybrid
decoder (titanlite/models/qwen3_5/) whose feed-forwards are mixtures of experts with a gated shared expert. Its spec;
its sizes, config.json, weights and plan are Qwen3.5's."""

from __future__ import annotations

from titanlite.models.common.decoder_args import moe_auxiliary_losses
from titanlite.models.qwen3_5 import args, hf_config
from titanlite.models.spec import HFConfig, ModelSpec

SPEC = ModelSpec(
    name="qwen3_5_moe",
    args_type=args.Qwen35MoEArgs,
    flavors=args.MOE_FLAVORS,
    model="titanlite.models.qwen3_5.model:Qwen35",
    tp_plan="titanlite.models.qwen3_5.parallelize:tp_plan",
    hf_weights="titanlite.models.qwen3_5.weights",
    tp_split_sizes=args.split_sizes,
    hf=HFConfig(hf_config.MOE_TEXT, hf_config.read_moe, hf_config.write, experts=True, also_reads=("qwen3_5_moe",)),
    moe=lambda a: a.moe,
    with_depth=args.with_depth,
    flops="titanlite.models.common.flops:moe_flops_per_token",
    auxiliary_losses=moe_auxiliary_losses,
    description="Qwen3.5-MoE: Qwen3.5's hybrid layers with mixtures of experts and a gated shared expert",
)
