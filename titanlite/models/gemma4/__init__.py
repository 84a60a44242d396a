"""Gemma 4 (text: Gemma4ForCausalLM, and the text model of the published multimodal folders): Gemma 3's block with
wider full-attention heads, keys equal to values there, proportional rotary, per-layer embeddings, layers reusing
earlier keys and values, a final logit softcap; and a mixture of experts beside each layer's MLP (26B-A4B, whose
named sizes are the family gemma4_moe's: titanlite/models/gemma4/moe_family.py). Its sizes, config.json and spec."""

from __future__ import annotations

from titanlite.models.common.decoder_args import moe_auxiliary_losses
from titanlite.models.gemma4 import args, hf_config
from titanlite.models.spec import HFConfig, ModelSpec


def gemma4_spec(name: str, flavors: dict, description: str) -> ModelSpec:
    """The spec of a Gemma 4 family: gemma4's module, plan, weight names and config.json (one reader, whose models
    are family gemma4, dense or not)."""
    return ModelSpec(
        name=name,
        args_type=args.Gemma4Args,
        flavors=flavors,
        model="titanlite.models.gemma4.model:Gemma4",
        tp_plan="titanlite.models.gemma4.parallelize:tp_plan",
        hf_weights="titanlite.models.gemma4.weights",
        tp_split_sizes=args.split_sizes,
        hf=HFConfig(
            hf_config.MODEL_TYPE,
            hf_config.read,
            hf_config.write,
            experts=True,
            also_reads=(hf_config.MULTIMODAL,),
            nullable=hf_config.NULLABLE,
            fields=hf_config.FIELDS,
        ),
        tp_refusal=args.tp_refusal,
        pp_refusal=args.pp_refusal,
        etp_refusal=lambda a: "MoE blocks' output norm (it would normalise each rank's partial sum)",
        with_depth=args.with_depth,
        flops="titanlite.models.gemma4.model:flops_per_token",
        auxiliary_losses=lambda a: moe_auxiliary_losses(a) if a.moe is not None else (),
        moe=lambda a: a.moe,
        description=description,
    )


SPEC = gemma4_spec(
    "gemma4",
    args.FLAVORS,
    "Gemma 4 (text): wider full-attention heads with keys equal to values, proportional rotary, per-layer "
    "embeddings, layers reusing keys/values, logit softcap (a gemma4_text config.json with experts reads as it too)",
)
