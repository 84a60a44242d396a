"""OLMo Hybrid (OlmoHybridForCausalLM): three pre-norm Gated DeltaNet layers, their write strength doubled, before each
of OLMo 2's post-norm attention layers (whole-projection Q/K norms; no rotations in the published checkpoints), on the
shared decoder. Its sizes, config.json and spec; under tensor parallelism the attention layers' whole-projection
norms are sharded with the heads (titanlite/models/common/parallelize.py WholeProjectionNorm)."""

from __future__ import annotations

from titanlite.models.common.linear_attention_args import split_sizes
from titanlite.models.olmo_hybrid import args, hf_config
from titanlite.models.spec import HFConfig, ModelSpec

SPEC = ModelSpec(
    name="olmo_hybrid",
    args_type=args.OlmoHybridArgs,
    flavors=args.FLAVORS,
    model="titanlite.models.olmo_hybrid.model:OlmoHybrid",
    tp_plan="titanlite.models.olmo_hybrid.parallelize:tp_plan",
    hf_weights="titanlite.models.olmo_hybrid.weights",
    tp_split_sizes=split_sizes,
    hf=HFConfig(
        hf_config.MODEL_TYPE, hf_config.read, hf_config.write, nullable=("rope_theta",), fields=hf_config.FIELDS
    ),
    with_depth=args.with_depth,
    description="OLMo Hybrid: 3 pre-norm Gated DeltaNet (beta x2) : 1 OLMo 2 post-norm attention layers, "
    "whole-projection Q/K norms, NoPE in the published checkpoints",
)
