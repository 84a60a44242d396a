"""Qwen3-Next's arguments, torch-free: Qwen3.5-MoE's (its hybrid Gated DeltaNet / gated attention decoder with a gated
shared expert), which may keep dense layers (decoder_sparse_step, mlp_only_layers) of width ffn_dim and may leave the
top-k unrenormalised; the published size of Qwen3-Next-80B-A3B."""

from __future__ import annotations

from dataclasses import dataclass, field

from titanlite.models.common.moe.args import MoEArgs
from titanlite.models.common.qwen_hybrid.args import DEBUG_SHAPE, QwenHybridMoEArgs, debug_moe
from titanlite.models.spec import not_math


@dataclass
class Qwen3NextArgs(QwenHybridMoEArgs):
    """Qwen3-Next (Qwen3NextForCausalLM): Qwen3.5-MoE's decoder; its folders fuse the linear layers' projections by
    key-head group (titanlite/models/qwen3_next/weights.py). ffn_dim is the dense layers' MLP width
    (intermediate_size), moe.expert_dim each routed expert's (moe_intermediate_size)."""

    family: str = not_math("qwen3_next")
    moe: MoEArgs = field(default_factory=debug_moe)


def _qwen3_next_80b_a3b() -> Qwen3NextArgs:
    """Qwen/Qwen3-Next-80B-A3B-{Base,Instruct,Thinking}'s config.json: 48 layers (12 x three Gated DeltaNet and one
    gated attention), every one a mixture of 512 experts of 512, 10 per token, and a gated shared expert of 512."""
    return Qwen3NextArgs(
        dim=2048,
        n_layers=48,
        n_heads=16,
        n_kv_heads=2,
        ffn_dim=5120,
        vocab_size=151936,
        max_seq_len=262144,
        rope_theta=1e7,
        head_dim=256,
        rotary_dim=64,
        linear_key_heads=16,
        linear_value_heads=32,
        linear_key_dim=128,
        linear_value_dim=128,
        moe=MoEArgs(
            n_experts=512,
            top_k=10,
            expert_dim=512,
            norm_topk_prob=True,
            shared_expert_dim=512,
            shared_gate=True,
        ),
    )


# vocab_size 0 (debug): the tokenizer's, padded.
FLAVORS = {
    # Tiny, for tests and CPU runs: Qwen3.5-MoE's debug shape (three linear layers and one full one, grouped value
    # heads, partial rotary, 8 experts of 32, 2 per token, a gated shared expert).
    "debug": Qwen3NextArgs(**DEBUG_SHAPE),
    "qwen3_next_80b_a3b": _qwen3_next_80b_a3b(),
}
