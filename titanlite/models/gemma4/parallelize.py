"""Gemma 4's tensor-parallel plan: the shared blocks' attention and MLP plan (its modules are named as Llama's),
minus the projections a layer lacks (no value projection where keys equal values, none of keys or values where a
layer reuses an earlier one's); per-head Q/K norms; the post-sublayer norms on the sequence-sharded outputs of the
row-wise projections; and the experts, where there are, whole on every rank (the MoE decoder's block plan).
Per-layer embeddings are refused before launch (spec tp_refusal)."""

from __future__ import annotations

from torch.distributed.tensor.parallel import SequenceParallel

from titanlite.models.common.interface import DecoderModule
from titanlite.models.common.parallelize import block_plan, moe_block_plan, per_head_norms
from titanlite.models.gemma4.model import Gemma4Block


def tp_plan(model: DecoderModule) -> dict:
    plan: dict = {}
    posts = ("post_attention_norm", "post_ffn_norm", "post_mlp_norm")
    for i, layer in model.layers.items():
        assert isinstance(layer, Gemma4Block)
        attention = layer.attention
        block = block_plan() | {name: SequenceParallel(use_local_output=True) for name in posts}
        block |= per_head_norms()
        if attention.wk is None:
            block.pop("attention.wk")
            block.pop("attention.k_norm")
        if attention.wv is None:
            block.pop("attention.wv")
        if layer.moe is None:
            block.pop("post_mlp_norm")
        else:
            block["moe"] = moe_block_plan()
        plan |= {f"layers.{i}.{name}": style for name, style in block.items()}
    return plan
