"""The MoE decoder's spec: the shared decoder (titanlite/models/common/decoder.py) whose feed-forwards are mixtures
of experts (titanlite/models/common/moe/), with transformers' pooled load-balancing loss, shared by the
mixture-of-experts families built on it. Not a family itself: `moe_decoder_spec` is how each such family describes
itself (its plan and FLOPs are this folder's)."""

from __future__ import annotations

from collections.abc import Callable

from titanlite.models.moe_decoder import args
from titanlite.models.spec import HFConfig, ModelSpec


def moe_decoder_spec(
    name: str, flavors: dict, read: Callable, write: Callable, hf_weights: str, description: str
) -> ModelSpec:
    """The spec of a family built by the MoE decoder: its module, plan and FLOPs are this folder's."""
    return ModelSpec(
        name=name,
        args_type=args.MoEDecoderArgs,
        flavors=flavors,
        model="titanlite.models.common.decoder:Transformer",
        tp_plan="titanlite.models.moe_decoder.parallelize:tp_plan",
        hf_weights=hf_weights,
        tp_split_sizes=args.split_sizes,
        hf=HFConfig(name, read, write, experts=True),
        with_depth=args.with_depth,
        flops="titanlite.models.common.flops:moe_flops_per_token",
        auxiliary_losses=args.auxiliary_losses,
        description=description,
    )
