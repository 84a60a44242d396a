"""Granite 4.0 H (GraniteMoeHybridForCausalLM, model_type granitemoehybrid): Mamba-2 or attention layers (no positions
in the published models) as layer_types says, each followed by a mixture of experts with a shared SwiGLU MLP beside it
(or that MLP alone), with muP-style multipliers of the embeddings, attention scores, residual adds and logits, on the
shared decoder. Its sizes, config.json and spec."""

from __future__ import annotations

from titanlite.models.common.decoder_args import moe_auxiliary_losses
from titanlite.models.common.mamba2_args import mamba_split_sizes
from titanlite.models.granitemoehybrid import args, hf_config
from titanlite.models.spec import HFConfig, ModelSpec

SPEC = ModelSpec(
    name="granitemoehybrid",
    args_type=args.GraniteMoeHybridArgs,
    flavors=args.FLAVORS,
    model="titanlite.models.granitemoehybrid.model:GraniteMoeHybrid",
    tp_plan="titanlite.models.granitemoehybrid.parallelize:tp_plan",
    hf_weights="titanlite.models.granitemoehybrid.weights",
    tp_split_sizes=mamba_split_sizes,
    hf=HFConfig(hf_config.MODEL_TYPE, hf_config.read, hf_config.write, experts=True, fields=hf_config.FIELDS),
    with_depth=args.with_depth,
    flops="titanlite.models.common.flops:moe_flops_per_token",
    auxiliary_losses=lambda a: moe_auxiliary_losses(a) if a.moe is not None else (),
    moe=lambda a: a.moe,
    description="Granite 4.0 H: Mamba-2 or attention (no positions) layers, each with a mixture of experts beside a "
    "shared SwiGLU MLP (or that MLP alone), muP-style multipliers",
)
