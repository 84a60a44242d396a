"""The specs of the families the shared decoder's switches describe (titanlite/models/common/decoder.py builds
them): `decoder_spec` for a dense one, `moe_decoder_spec` for one whose feed-forwards are mixtures of experts. A
family's folder calls one with its flavors and config.json, and keeps nothing else."""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType

from titanlite.base.hf_config import FieldTypes
from titanlite.models.common import decoder_args
from titanlite.models.common.decoder_config import DecoderConfig
from titanlite.models.common.moe.hf_config import MOE_FIELDS
from titanlite.models.spec import HFConfig, ModelSpec


def tp_refusal(a: decoder_args.DecoderArgs) -> str | None:
    """The refusal of a family whose tensor-parallel plan leaves a whole-projection Q/K norm (qk_norm "full")
    unsharded. The shared plans shard it (titanlite/models/common/parallelize.py whole_projection_norms), so the
    shared decoder's families need none; a family with a plan of its own names this until its plan does too."""
    if a.qk_norm == "full":
        return (
            "model qk_norm 'full' (a norm over each token's whole query and key, which tensor parallelism "
            "splits over ranks)"
        )
    return None


def decoder_spec(
    name: str, flavors: dict, hf: DecoderConfig, description: str, fields: FieldTypes = MappingProxyType({})
) -> ModelSpec:
    """The spec of a family built by the Llama decoder: its module, weight names and TP plan are this folder's;
    `fields`, the config.json fields its reader takes beyond the shared ones (HFConfig.fields)."""
    return ModelSpec(
        name=name,
        args_type=decoder_args.DecoderArgs,
        flavors=flavors,
        model="titanlite.models.common.decoder:Transformer",
        tp_plan="titanlite.models.common.parallelize:tp_plan",
        hf_weights="titanlite.models.common.decoder_weights",
        tp_split_sizes=decoder_args.tp_split_sizes,
        hf=HFConfig(hf.model_type, hf.read, hf.write, fields=fields),
        with_depth=decoder_args.with_depth,
        description=description,
    )


def moe_decoder_spec(
    name: str,
    flavors: dict,
    read: Callable,
    write: Callable,
    hf_weights: str,
    description: str,
    args_type: type = decoder_args.MoEDecoderArgs,
    model: str = "titanlite.models.common.decoder:Transformer",
    tp_plan: str = "titanlite.models.common.parallelize:moe_tp_plan",
    tp_split_sizes: Callable = decoder_args.moe_split_sizes,
    with_depth: Callable = decoder_args.moe_with_depth,
    fields: FieldTypes = MOE_FIELDS,
    auxiliary_losses: Callable = decoder_args.moe_auxiliary_losses,
) -> ModelSpec:
    """The spec of a family whose blocks hold mixtures of experts (`args_type`: its arguments, a subclass of
    MoEDecoderArgs where it has its own defaults, or another WithExperts): its experts, FLOPs and auxiliary losses
    are the shared ones; its module, tensor-parallel plan, split sizes and depth rule the MoE decoder's unless it
    names its own (DeepSeek-V3's and Kimi Linear's latent attention), and its auxiliary losses too where it adds its own
    (DeepSeek-V3.2's indexer loss). `fields`: the config.json fields its reader
    takes beyond the shared ones (HFConfig.fields), the mixture of experts' unless it names more."""
    return ModelSpec(
        name=name,
        args_type=args_type,
        flavors=flavors,
        model=model,
        tp_plan=tp_plan,
        hf_weights=hf_weights,
        tp_split_sizes=tp_split_sizes,
        hf=HFConfig(name, read, write, experts=True, fields=fields),
        moe=lambda a: a.moe,
        with_depth=with_depth,
        flops="titanlite.models.common.flops:moe_flops_per_token",
        auxiliary_losses=auxiliary_losses,
        description=description,
    )
