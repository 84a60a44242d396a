"""Qwen3.5 (Qwen3_5ForCausalLM, and the text model of the published multimodal folders): three Gated DeltaNet
linear-attention layers before each gated full-attention layer, on the shared decoder. Its sizes, config.json and
spec; Qwen3.5-MoE's are titanlite/models/qwen3_5_moe/."""

from __future__ import annotations

from titanlite.models.qwen3_5 import args, hf_config
from titanlite.models.spec import HFConfig, ModelSpec

SPEC = ModelSpec(
    name="qwen3_5",
    args_type=args.Qwen35Args,
    flavors=args.FLAVORS,
    model="titanlite.models.qwen3_5.model:Qwen35",
    tp_plan="titanlite.models.qwen3_5.parallelize:tp_plan",
    hf_weights="titanlite.models.qwen3_5.weights",
    tp_split_sizes=args.split_sizes,
    hf=HFConfig(hf_config.TEXT, hf_config.read, hf_config.write, also_reads=("qwen3_5",)),
    with_depth=args.with_depth,
    description="Qwen3.5: 3 Gated DeltaNet (linear attention) : 1 gated full-attention layers, partial rotary, "
    "(1 + w) RMSNorms",
)
