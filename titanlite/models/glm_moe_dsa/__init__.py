"""GLM-5 (GlmMoeDsaForCausalLM, model_type glm_moe_dsa: GLM-5, 5.1, 5.2): DeepSeek-V3.2's sparse attention (its indexer
rotating adjacent pairs) and mixture of experts, in GLM's sizes. Its sizes, config.json both ways and its spec; its
module, weights and tensor-parallel plan are DeepSeek-V3's."""

from __future__ import annotations

from titanlite.models.common.decoder_spec import moe_decoder_spec
from titanlite.models.deepseek_v3.args import split_sizes
from titanlite.models.deepseek_v32 import auxiliary_losses
from titanlite.models.glm_moe_dsa import args, hf_config

SPEC = moe_decoder_spec(
    "glm_moe_dsa",
    args.FLAVORS,
    hf_config.read,
    hf_config.write,
    "titanlite.models.deepseek_v3.weights",
    "GLM-5: DeepSeek-V3.2's sparse attention through a lightning indexer and its mixture of experts, in GLM's sizes",
    args_type=args.GlmMoeDsaArgs,
    model="titanlite.models.deepseek_v3.model:DeepseekV3",
    tp_plan="titanlite.models.common.latent.parallelize:tp_plan",
    tp_split_sizes=split_sizes,
    fields=hf_config.FIELDS,
    auxiliary_losses=auxiliary_losses,
)
