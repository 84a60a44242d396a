"""Qwen3-MoE's arguments, torch-free: the Llama decoder's (with Qwen3's per-head Q/K norms) and one MoEArgs for
its mixture-of-experts blocks; its sizes (a tiny debug model and Qwen3-30B-A3B)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from titanlite.models.common.moe_args import MoEArgs
from titanlite.models.llama3.args import LlamaArgs, tp_split_sizes


def _debug_moe() -> MoEArgs:
    return MoEArgs(n_experts=8, top_k=2, expert_dim=32, norm_topk_prob=True, dense_layers=(1,))


@dataclass
class MoEDecoderArgs(LlamaArgs):
    """The Llama decoder (ffn_dim: the width of the dense layers' feed-forward, config.json intermediate_size)
    whose blocks hold `moe` instead of the dense feed-forward, except at moe.dense_layers."""

    moe: MoEArgs = field(default_factory=_debug_moe)
    family: str = "qwen3_moe"

    def __post_init__(self) -> None:
        super().__post_init__()
        beyond = [i for i in self.moe.dense_layers if i >= self.n_layers]
        if beyond:
            raise ValueError(f"MoEArgs.dense_layers={list(self.moe.dense_layers)} names layers beyond n_layers")


def with_depth(args: MoEDecoderArgs, n_layers: int) -> dict:
    """model.n_layers: the depth, keeping the dense layers that still exist."""
    dense = tuple(i for i in args.moe.dense_layers if i < n_layers)
    return {"n_layers": n_layers, "moe": dataclasses.replace(args.moe, dense_layers=dense)}


def split_sizes(args: MoEDecoderArgs) -> dict[str, int]:
    return tp_split_sizes(args)


def tp_refusal(args: MoEDecoderArgs) -> str | None:
    """Tensor parallelism would leave the experts whole on every rank with a replicated input, which this
    family's plan does not express yet: refused until expert parallelism lands."""
    return (
        f"experts of {args.family}'s mixture-of-experts blocks (not split by tensor parallelism yet; shard them "
        "with parallelism.data_parallel_shard_degree)"
    )


def auxiliary_losses(args: MoEDecoderArgs) -> tuple[str, ...]:
    names = ("load_balance",) if args.moe.balance == "aux_loss" and args.moe.aux_loss_coef > 0 else ()
    return names + (("router_z",) if args.moe.z_loss_coef > 0 else ())


def _qwen3_moe_30b_a3b() -> MoEDecoderArgs:
    """Qwen/Qwen3-30B-A3B: 48 layers, every one sparse (128 experts, 8 per token, 768 wide), untied."""
    return MoEDecoderArgs(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        ffn_dim=6144,
        vocab_size=151936,
        max_seq_len=40960,
        rope_theta=1e6,
        norm_eps=1e-6,
        tie_embeddings=False,
        head_dim=128,
        qk_norm="head",
        moe=MoEArgs(n_experts=128, top_k=8, expert_dim=768, norm_topk_prob=True, aux_loss_coef=0.001),
    )


# vocab_size 0: the tokenizer's, padded to a multiple of 64.
FLAVORS = {
    # dim 64, 4 layers (layer 1 dense, as mlp_only_layers=[1]), 8 experts of width 32, 2 per token.
    "debug": MoEDecoderArgs(
        dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=192, vocab_size=0, head_dim=32, qk_norm="head"
    ),
    "qwen3_moe_30b_a3b": _qwen3_moe_30b_a3b(),
}
