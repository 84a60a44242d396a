"""OLMo Hybrid's tensor-parallel plan, from shared pieces (titanlite/models/common/parallelize.py): the Gated DeltaNet
layers as every Gated DeltaNet layer is split (linear_attention_plan: every projection by heads, the per-head
parameters sharded with them), the attention layers as the shared block plan (OLMo 2's post norms sequence-parallel,
handing back local tensors) with their whole-projection Q/K norms (qk_norm "full") sharded with the heads, the sum of
squares all-reduced over the ranks (WholeProjectionNorm)."""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

from titanlite.models.common.interface import DecoderModule
from titanlite.models.common.parallelize import block_plan, linear_attention_plan, post_norms, qk_norms
from titanlite.models.olmo_hybrid.args import OlmoHybridArgs


def tp_plan(model: DecoderModule) -> dict:
    args = model.args
    assert isinstance(args, OlmoHybridArgs), type(args).__name__
    plan: dict = {}
    for i in model.layers:
        block = block_plan()
        if args.layer_types[int(i)] == "linear_attention":
            block = {k: v for k, v in block.items() if not k.startswith("attention")} | linear_attention_plan()
            block["attention_norm"] = SequenceParallel()
        else:
            block |= qk_norms(args) | post_norms()
            if not args.rope:  # attention(x): no rotary tables come in
                block["attention"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan |= {f"layers.{i}.{name}": style for name, style in block.items()}
    return plan
