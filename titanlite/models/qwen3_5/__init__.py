"""Qwen3.5 (Qwen3_5ForCausalLM, and the text model of the published multimodal folders): three Gated DeltaNet
linear-attention layers before each gated full-attention layer, the hybrid decoder of
titanlite/models/common/qwen_hybrid/. Its sizes and spec."""

from __future__ import annotations

from functools import partial

from titanlite.models.common.linear_attention_args import split_sizes
from titanlite.models.common.qwen_hybrid import hf_config
from titanlite.models.common.qwen_hybrid.args import with_depth
from titanlite.models.qwen3_5.args import FLAVORS, Qwen35Args
from titanlite.models.spec import HFConfig, ModelSpec

SPEC = ModelSpec(
    name="qwen3_5",
    args_type=Qwen35Args,
    flavors=FLAVORS,
    model="titanlite.models.common.qwen_hybrid.model:QwenHybridDecoder",
    tp_plan="titanlite.models.common.qwen_hybrid.parallelize:tp_plan",
    hf_weights="titanlite.models.common.qwen_hybrid.weights",
    tp_split_sizes=split_sizes,
    hf=HFConfig(
        hf_config.TEXT,
        partial(hf_config.read, cls=Qwen35Args),
        hf_config.write,
        also_reads=("qwen3_5",),
        fields=hf_config.FIELDS,
    ),
    with_depth=with_depth,
    description="Qwen3.5: 3 Gated DeltaNet (linear attention) : 1 gated full-attention layers, partial rotary, "
    "(1 + w) RMSNorms",
)
