"""The hybrid decoder's tensor-parallel plan (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): the shared block plan (with the query
gate wg split as wq is) on the full-attention layers; on the Gated DeltaNet layers every projection split column-wise by
heads (each rank holds whole key heads and the value heads that read them), the convolutions' weights, A_log and dt_bias
sharded with them, the per-head output norm replicated (its gradient summed over TP), and the output projection
row-wise. The MoE blocks whole on every rank (the shared decoder's moe_block_plan)."""

from __future__ import annotations

from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from titanlite.models.common.decoder_args import kind_of
from titanlite.models.common.interface import DecoderModule
from titanlite.models.common.parallelize import MixerInput, block_plan, moe_block_plan, per_head_norms

PER_HEAD = ("conv_q", "conv_k", "conv_v", "A_log", "dt_bias")  # parameters whose first dimension runs over heads


def linear_attention_plan() -> dict:
    return {
        "attention": MixerInput(PER_HEAD),
        **{f"attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv", "wz", "wa", "wb")},
        "attention.norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    }


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
