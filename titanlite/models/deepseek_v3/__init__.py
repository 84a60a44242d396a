"""DeepSeek-V3 (DeepseekV3ForCausalLM): multi-head latent attention and a mixture of experts with sigmoid scores,
group-limited top-k, a correction bias balanced without an auxiliary loss, and shared experts; the first layers
dense. Its sizes (a tiny debug model, DeepSeek-V3 671B, DeepSeek-V2-Lite's and Moonlight's shapes), config.json
both ways and its spec. The folder also holds two families built on DeepSeek-V3's module, weights and plan, whose
latent attention is sparse: DeepSeek-V3.2 (deepseek_v32.py) and GLM-5 (glm_moe_dsa.py), their sizes in sparse_args.py
and DeepSeek-V3.2's config.json in sparse_hf_config.py."""

from __future__ import annotations

from titanlite.models.common.decoder_spec import moe_decoder_spec
from titanlite.models.deepseek_v3 import args, hf_config

SPEC = moe_decoder_spec(
    "deepseek_v3",
    args.FLAVORS,
    hf_config.read,
    hf_config.write,
    "titanlite.models.deepseek_v3.weights",
    "DeepSeek-V3: multi-head latent attention, sigmoid-routed experts in groups with a balancing bias and shared "
    "experts, the first layers dense",
    args_type=args.DeepseekV3Args,
    model="titanlite.models.deepseek_v3.model:DeepseekV3",
    tp_plan="titanlite.models.common.latent.parallelize:tp_plan",
    tp_split_sizes=args.split_sizes,
    fields=hf_config.FIELDS,
)
