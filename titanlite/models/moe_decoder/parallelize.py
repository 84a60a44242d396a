"""The MoE decoder's tensor-parallel plan: the Llama decoder's for attention and the dense layers' feed-forward; a
mixture-of-experts block runs whole on every tensor-parallel rank.

Tensor parallelism does not split the experts (expert parallelism does, over the data-parallel ranks): the block
takes the full sequence (gathered from the sequence-parallel shards), routes it and runs its experts on every
tensor-parallel rank alike, then keeps its rank's slice of the sequence. Each rank's router, shared expert and
experts so see the same tokens and get the same gradients, so nothing needs summing over tensor parallelism; the
price is the block's compute repeated tp times (TorchTitan instead splits the routed tokens over those ranks)."""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInputOutput

from titanlite.models.common.interface import DecoderModule
from titanlite.models.llama3.parallelize import block_plan, per_head_norms


def moe_block_plan() -> PrepareModuleInputOutput:
    """The MoE block: the sequence gathered in, this rank's slice of the sequence out (plain tensors, as the
    attention's and dense feed-forward's outputs are in the Llama plan)."""
    return PrepareModuleInputOutput(
        input_layouts=(Shard(1),),
        desired_input_layouts=(Replicate(),),
        use_local_input=True,
        output_layouts=(Replicate(),),
        desired_output_layouts=(Shard(1),),
        use_local_output=True,
    )


def tp_plan(model: DecoderModule) -> dict:
    plan = {}
    for i in model.layers:
        dense = not model.args.moe.is_sparse(int(i))
        for name, style in (per_head_norms() | block_plan()).items():
            if dense or not name.startswith("feed_forward"):
                plan[f"layers.{i}.{name}"] = style
        if not dense:
            plan[f"layers.{i}.feed_forward"] = moe_block_plan()
    return plan
