"""GPT-2's tensor-parallel plan for its blocks (titanlite/parallel/tensor_parallel.py adds the embedding,
final norm and output ends and applies it): the shared block's, for attention without RoPE tables and a GELU MLP."""

from __future__ import annotations

from titanlite.models.common.interface import DecoderModule
from titanlite.models.common.parallelize import block_plan


def tp_plan(model: DecoderModule) -> dict:
    block = block_plan(rotary=False, gated=False)
    return {f"layers.{i}.{name}": style for i in model.layers for name, style in block.items()}
