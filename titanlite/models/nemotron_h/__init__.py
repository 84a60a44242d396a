"""Nemotron-H and Nemotron 3 (NemotronHForCausalLM): layers of one sublayer each behind its own RMSNorm, Mamba-2
mixers, attention without positions, relu^2 MLPs and mixtures of experts as hybrid_override_pattern says ("M", "*",
"-", "E"), on the shared decoder. Its sizes, config.json and spec."""

from __future__ import annotations

from titanlite.models.common.decoder_args import moe_auxiliary_losses
from titanlite.models.common.mamba2_args import mamba_split_sizes
from titanlite.models.nemotron_h import args, hf_config
from titanlite.models.spec import HFConfig, ModelSpec


def etp_refusal(model_args: args.NemotronHArgs) -> str | None:
    return "its experts are relu^2 feed-forwards without gates, which expert tensor parallelism does not split"


SPEC = ModelSpec(
    name="nemotron_h",
    args_type=args.NemotronHArgs,
    flavors=args.FLAVORS,
    model="titanlite.models.nemotron_h.model:NemotronH",
    tp_plan="titanlite.models.nemotron_h.parallelize:tp_plan",
    hf_weights="titanlite.models.nemotron_h.weights",
    tp_split_sizes=mamba_split_sizes,
    hf=HFConfig(hf_config.MODEL_TYPE, hf_config.read, hf_config.write, experts=True, fields=hf_config.FIELDS),
    with_depth=args.with_depth,
    flops="titanlite.models.common.flops:moe_flops_per_token",
    auxiliary_losses=lambda a: moe_auxiliary_losses(a) if a.moe is not None else (),
    moe=lambda a: a.moe,
    etp_refusal=etp_refusal,
    description="Nemotron-H and Nemotron 3: Mamba-2, attention (no positions), relu^2 MLP and mixture-of-experts "
    "layers, one sublayer each, as hybrid_override_pattern says",
)
