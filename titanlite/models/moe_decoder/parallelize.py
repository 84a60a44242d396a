"""The MoE decoder's tensor-parallel plan: the Llama decoder's for attention and the dense layers' feed-forward. The
spec refuses tensor parallelism for these families (args.tp_refusal) until expert parallelism splits the experts, so
the plan is written for the day it does, and for a plan's reader: the MoE blocks are not in it."""

from __future__ import annotations

from titanlite.models.common.interface import DecoderModule
from titanlite.models.llama3.parallelize import block_plan, per_head_norms


def tp_plan(model: DecoderModule) -> dict:
    plan = {}
    for i in model.layers:
        dense = not model.args.moe.is_sparse(int(i))
        for name, style in (per_head_norms() | block_plan()).items():
            if dense or not name.startswith("feed_forward"):
                plan[f"layers.{i}.{name}"] = style
    return plan
