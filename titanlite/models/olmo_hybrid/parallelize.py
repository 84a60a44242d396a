"""OLMo Hybrid's tensor-parallel plan, from shared pieces: the Gated DeltaNet layers as Qwen3.5's (every projection
split by heads, the per-head parameters sharded with them), the attention layers as the shared block plan (OLMo 2's
post norms sequence-parallel). The spec refuses tensor_parallel_degree > 1 while the attention layers normalise each
token's whole query and key (qk_norm "full", as OLMo 2's), which a split by heads would cut; the plan stands for the
layers that could be split."""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

from titanlite.models.common.hybrid.parallelize import linear_attention_plan
from titanlite.models.common.interface import DecoderModule
from titanlite.models.common.parallelize import block_plan


def tp_plan(model: DecoderModule) -> dict:
    plan: dict = {}
    for i in model.layers:
        block = block_plan()
        if model.args.layer_types[int(i)] == "linear_attention":
            block = {k: v for k, v in block.items() if not k.startswith("attention")} | linear_attention_plan()
            block["attention_norm"] = SequenceParallel()
        elif not model.args.rope:  # attention(x): no rotary tables come in
            block["attention"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan |= {f"layers.{i}.{name}": style for name, style in block.items()}
    return plan
