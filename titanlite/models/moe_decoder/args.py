"""The MoE decoder's arguments, torch-free: the Llama decoder's and one MoEArgs for its mixture-of-experts blocks,
shared by the families built on it (each folder sets its family and sizes)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from titanlite.models.common.decoder_args import DecoderArgs, tp_split_sizes
from titanlite.models.common.moe.args import MoEArgs


def _debug_moe() -> MoEArgs:
    return MoEArgs(n_experts=8, top_k=2, expert_dim=32, norm_topk_prob=True, dense_layers=(1,))


@dataclass
class MoEDecoderArgs(DecoderArgs):
    """The Llama decoder (ffn_dim: the width of the dense layers' feed-forward, config.json intermediate_size)
    whose blocks hold `moe` instead of the dense feed-forward, except at moe.dense_layers."""

    moe: MoEArgs = field(default_factory=_debug_moe)

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


def auxiliary_losses(args: MoEDecoderArgs) -> tuple[str, ...]:
    names = ("load_balance",) if args.moe.balance == "aux_loss" and args.moe.aux_loss_coef > 0 else ()
    return names + (("router_z",) if args.moe.z_loss_coef > 0 else ())
