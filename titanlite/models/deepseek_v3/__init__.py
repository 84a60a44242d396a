"""DeepSeek-V3 (DeepseekV3ForCausalLM): multi-head latent attention and a mixture of experts with sigmoid scores,
group-limited top-k, a correction bias balanced without an auxiliary loss, and shared experts; the first layers
dense. Its sizes (a tiny debug model, DeepSeek-V3 671B, DeepSeek-V2-Lite's and Moonlight's shapes), config.json
both ways and its spec. Multi-token prediction is not built (titanlite/models/deepseek_v3/hf_config.py)."""

from __future__ import annotations

from titanlite.models.deepseek_v3 import args, hf_config
from titanlite.models.spec import HFConfig, ModelSpec

SPEC = ModelSpec(
    name="deepseek_v3",
    args_type=args.DeepseekV3Args,
    flavors=args.FLAVORS,
    model="titanlite.models.deepseek_v3.model:DeepseekV3",
    tp_plan="titanlite.models.deepseek_v3.parallelize:tp_plan",
    hf_weights="titanlite.models.deepseek_v3.weights",
    tp_split_sizes=args.split_sizes,
    hf=HFConfig(hf_config.MODEL_TYPE, hf_config.read, hf_config.write, experts=True),
    moe=lambda a: a.moe,
    with_depth=args.with_depth,
    flops="titanlite.models.common.flops:moe_flops_per_token",
    auxiliary_losses=args.auxiliary_losses,
    description="DeepSeek-V3: multi-head latent attention, sigmoid-routed experts in groups with a balancing bias "
    "and shared experts, the first layers dense",
)
