"""Qwen3.5-MoE (Qwen3_5MoeForCausalLM, and the text model of the published multimodal folders): the hybrid decoder
(titanlite/models/common/qwen_hybrid/) whose feed-forwards are mixtures of experts with a gated shared expert. Its sizes
and spec."""

from __future__ import annotations

from functools import partial

from titanlite.models.common.decoder_args import moe_auxiliary_losses
from titanlite.models.common.linear_attention_args import split_sizes
from titanlite.models.common.qwen_hybrid import hf_config
from titanlite.models.common.qwen_hybrid.args import with_depth
from titanlite.models.qwen3_5_moe.args import FLAVORS, Qwen35MoEArgs
from titanlite.models.spec import HFConfig, ModelSpec

SPEC = ModelSpec(
    name="qwen3_5_moe",
    args_type=Qwen35MoEArgs,
    flavors=FLAVORS,
    model="titanlite.models.common.qwen_hybrid.model:QwenHybridDecoder",
    tp_plan="titanlite.models.common.qwen_hybrid.parallelize:tp_plan",
    hf_weights="titanlite.models.common.qwen_hybrid.weights",
    tp_split_sizes=split_sizes,
    hf=HFConfig(
        hf_config.MOE_TEXT,
        partial(hf_config.read_moe, cls=Qwen35MoEArgs),
        hf_config.write,
        experts=True,
        also_reads=("qwen3_5_moe",),
        fields=hf_config.EXPERT_FIELDS,
    ),
    moe=lambda a: a.moe,
    with_depth=with_depth,
    flops="titanlite.models.common.flops:moe_flops_per_token",
    auxiliary_losses=moe_auxiliary_losses,
    description="Qwen3.5-MoE: Qwen3.5's hybrid layers with mixtures of experts and a gated shared expert",
)
