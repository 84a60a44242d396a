"""Qwen3.5-MoE's arguments, torch-free: the hybrid decoder's with mixtures of experts
(titanlite/models/common/qwen_hybrid/args.py) under its name, and the published sizes."""

from __future__ import annotations

from dataclasses import dataclass

from titanlite.models.common.moe.args import MoEArgs
from titanlite.models.common.qwen_hybrid.args import DEBUG_SHAPE, QwenHybridMoEArgs
from titanlite.models.spec import not_math


@dataclass
class Qwen35MoEArgs(QwenHybridMoEArgs):
    """Qwen3.5-MoE: Qwen3.5's decoder whose every feed-forward is a mixture of experts (softmax router, top-k
    renormalised, one shared expert scaled by a sigmoid gate); ffn_dim is the experts' width."""

    family: str = not_math("qwen3_5_moe")


def _moe(dim, n_layers, n_heads, experts, top_k, expert_dim, value_heads) -> Qwen35MoEArgs:
    return Qwen35MoEArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=2,
        ffn_dim=expert_dim,
        vocab_size=248320,
        max_seq_len=262144,
        head_dim=256,
        rotary_dim=64,
        linear_key_heads=16,
        linear_value_heads=value_heads,
        moe=MoEArgs(
            n_experts=experts,
            top_k=top_k,
            expert_dim=expert_dim,
            norm_topk_prob=True,
            shared_expert_dim=expert_dim,
            shared_gate=True,
        ),
    )


# The text models of Qwen/Qwen3.5-*-A*B (their config.json text_config).
FLAVORS = {
    # Every layer a mixture: ffn_dim is the experts' width, as a qwen3_5_moe config.json reads back.
    "debug": Qwen35MoEArgs(**DEBUG_SHAPE | {"ffn_dim": 32}),
    "qwen3_5_moe_35b_a3b": _moe(2048, 40, 16, 256, 8, 512, 32),
    "qwen3_5_moe_122b_a10b": _moe(3072, 48, 32, 256, 8, 1024, 64),
    "qwen3_5_moe_397b_a17b": _moe(4096, 60, 32, 512, 10, 1024, 64),
}
