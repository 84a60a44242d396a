"""Qwen3-Next (Qwen3NextForCausalLM; Qwen3-Next-80B-A3B): Qwen3.5-MoE's hybrid decoder (three Gated DeltaNet layers
before each gated full-attention layer, mixtures of experts with a gated shared expert;
titanlite/models/common/qwen_hybrid/),
its folders' linear-layer projections fused by key-head group. Its spec; its sizes, config.json and weight names
here, its model and plan Qwen3.5's."""

from __future__ import annotations

from titanlite.models.common.decoder_args import moe_auxiliary_losses
from titanlite.models.common.linear_attention_args import split_sizes
from titanlite.models.common.qwen_hybrid.args import with_depth
from titanlite.models.qwen3_next import args, hf_config
from titanlite.models.spec import HFConfig, ModelSpec

SPEC = ModelSpec(
    name="qwen3_next",
    args_type=args.Qwen3NextArgs,
    flavors=args.FLAVORS,
    model="titanlite.models.common.qwen_hybrid.model:QwenHybridDecoder",
    tp_plan="titanlite.models.common.qwen_hybrid.parallelize:tp_plan",
    hf_weights="titanlite.models.qwen3_next.weights",
    tp_split_sizes=split_sizes,
    hf=HFConfig(hf_config.MODEL_TYPE, hf_config.read, hf_config.write, experts=True, fields=hf_config.FIELDS),
    moe=lambda a: a.moe,
    with_depth=with_depth,
    flops="titanlite.models.common.flops:moe_flops_per_token",
    auxiliary_losses=moe_auxiliary_losses,
    description="Qwen3-Next: Qwen3.5-MoE's hybrid layers (Gated DeltaNet and gated attention, gated shared expert), "
    "projections fused by key-head group in its folders",
)
