"""Nemotron-H's tensor-parallel plan, from shared pieces (titanlite/models/common/parallelize.py): each layer's one
sublayer split as the shared plans split it: Mamba-2 by heads and groups (mamba2_plan), attention (which reads no
rotary tables) and the MLP (which has no gate) as the shared block plan, a mixture of experts whole on every rank
(moe_block_plan; expert parallelism splits the experts)."""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput

from titanlite.models.common.interface import DecoderModule
from titanlite.models.common.parallelize import block_plan, mamba2_plan, moe_block_plan
from titanlite.models.nemotron_h.args import NemotronHArgs


def tp_plan(model: DecoderModule) -> dict:
    args = model.args
    assert isinstance(args, NemotronHArgs), type(args).__name__
    shared = block_plan(rotary=False, gated=False)
    attention = {k: v for k, v in shared.items() if k.startswith("attention")}
    attention["attention"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    mlp = {k: v for k, v in shared.items() if k.startswith(("ffn_norm", "feed_forward"))}
    moe = {"ffn_norm": shared["ffn_norm"], "feed_forward": moe_block_plan()}  # the block whole on every rank
    kinds = {"full_attention": attention, "mlp": mlp, "moe": moe}
    plan: dict = {}
    for i in model.layers:
        if int(i) >= args.n_layers:  # a multi-token prediction depth's block: attention, then the experts
            plan |= {f"layers.{i}.{name}": style for name, style in (attention | moe).items()}
            continue
        kind = args.layer_types[int(i)]
        block = mamba2_plan() if kind == "mamba" else kinds[kind]
        plan |= {f"layers.{i}.{name}": style for name, style in block.items()}
    return plan
