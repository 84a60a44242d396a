"""GLM-4.5's tensor-parallel plan: the shared MoE decoder's (titanlite/models/common/parallelize.py moe_tp_plan:
attention split by heads, the QKV biases with their columns, per-head Q/K norms replicated; the MoE blocks whole on
every rank), without the Q/K norms' entries where the model has none (GLM-4.5-Air: use_qk_norm false), which torch
would otherwise warn about once per layer."""

from __future__ import annotations

from titanlite.models.common.interface import DecoderModule
from titanlite.models.common.parallelize import moe_tp_plan


def tp_plan(model: DecoderModule) -> dict:
    plan = moe_tp_plan(model)
    if model.args.qk_norm == "head":
        return plan
    return {name: style for name, style in plan.items() if not name.endswith(("attention.q_norm", "attention.k_norm"))}
