"""Gemma 3's tensor-parallel plan: Llama's block plan (its modules are named as Llama's) and per-head Q/K norms,
plus the two post-sublayer norms, which normalise the sequence-sharded outputs of the row-wise projections."""

from __future__ import annotations

from torch.distributed.tensor.parallel import SequenceParallel

from titanlite.models.common.interface import DecoderModule
from titanlite.models.common.parallelize import block_plan, per_head_norms


def tp_plan(model: DecoderModule) -> dict:
    # Local outputs: the residual adds them to the block's (local, sequence-sharded) input.
    post = {name: SequenceParallel(use_local_output=True) for name in ("post_attention_norm", "post_ffn_norm")}
    block = per_head_norms() | block_plan() | post
    return {f"layers.{i}.{name}": style for i in model.layers for name, style in block.items()}
