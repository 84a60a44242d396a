"""Falcon-H1 (FalconH1ForCausalLM): in every layer grouped-query attention with RoPE and a Mamba-2 mixer side by side
on one normed input, then a SwiGLU MLP, with the muP multipliers its config.json gives, on the shared decoder. Its
sizes, config.json and spec."""

from __future__ import annotations

from titanlite.models.common.mamba2_args import mamba_split_sizes
from titanlite.models.falcon_h1 import args, hf_config
from titanlite.models.spec import HFConfig, ModelSpec

SPEC = ModelSpec(
    name="falcon_h1",
    args_type=args.FalconH1Args,
    flavors=args.FLAVORS,
    model="titanlite.models.falcon_h1.model:FalconH1",
    tp_plan="titanlite.models.falcon_h1.parallelize:tp_plan",
    hf_weights="titanlite.models.falcon_h1.weights",
    tp_split_sizes=mamba_split_sizes,
    hf=HFConfig(hf_config.MODEL_TYPE, hf_config.read, hf_config.write, fields=hf_config.FIELDS),
    description="Falcon-H1: attention and a Mamba-2 mixer side by side in every layer, then a SwiGLU MLP, with muP "
    "multipliers",
)
