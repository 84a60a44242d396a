"""Granite 4.0 H's tensor-parallel plan, from shared pieces (titanlite/models/common/parallelize.py): each layer's
mixer split as the shared plans split it, Mamba-2 by heads and groups (mamba2_plan), attention by heads (block_plan;
it reads the rotary tables only where the model rotates); its mixture of experts whole on every rank
(moe_block_plan; expert parallelism splits the experts), or the shared MLP alone split as the shared block's."""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput

from titanlite.models.common.interface import DecoderModule
from titanlite.models.common.parallelize import block_plan, mamba2_plan, moe_block_plan
from titanlite.models.granitemoehybrid.args import GraniteMoeHybridArgs


def tp_plan(model: DecoderModule) -> dict:
    args = model.args
    assert isinstance(args, GraniteMoeHybridArgs), type(args).__name__
    shared = block_plan(rotary=args.rope)
    attention = {k: v for k, v in shared.items() if k.startswith("attention")}
    if not args.rope:  # attention(x): no rotary tables come in
        attention["attention"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    if args.moe is not None:
        feed_forward = {"ffn_norm": shared["ffn_norm"], "feed_forward": moe_block_plan()}
    else:
        feed_forward = {k: v for k, v in shared.items() if k.startswith(("ffn_norm", "feed_forward"))}
    plan: dict = {}
    for i in model.layers:
        mixer = mamba2_plan() if args.layer_types[int(i)] == "mamba" else attention
        plan |= {f"layers.{i}.{name}": style for name, style in (mixer | feed_forward).items()}
    return plan
