"""The Qwen hybrid decoder's tensor-parallel plan (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): the shared block plan (with the
query gate wg split as wq is) on the full-attention layers; the Gated DeltaNet layers as the shared plan splits them
(titanlite/models/common/parallelize.py linear_attention_plan: every projection by heads, the per-head parameters
sharded with them). The MoE blocks whole on every rank (the shared decoder's moe_block_plan)."""

from __future__ import annotations

from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel

from titanlite.models.common.decoder_args import kind_of
from titanlite.models.common.interface import DecoderModule
from titanlite.models.common.parallelize import block_plan, linear_attention_plan, moe_block_plan, per_head_norms


def tp_plan(model: DecoderModule) -> dict:
    plan: dict = {}
    moe = getattr(model.args, "moe", None)
    for i in model.layers:
        block = per_head_norms() | block_plan() | {"attention.wg": ColwiseParallel()}
        if kind_of(model.args, int(i)) == "linear_attention":
            block = {k: v for k, v in block.items() if not k.startswith("attention")} | linear_attention_plan()
            block["attention_norm"] = SequenceParallel()
        if moe is not None and moe.is_sparse(int(i)):
            block = {k: v for k, v in block.items() if not k.startswith("feed_forward")}
            block["feed_forward"] = moe_block_plan()
        plan |= {f"layers.{i}.{name}": style for name, style in block.items()}
    return plan
