"""Nemotron-H (NemotronHForCausalLM): layers of one sublayer each behind its own RMSNorm, Mamba-2 mixers, attention
without positions and relu^2 MLPs as hybrid_override_pattern says ("M", "*", "-"), on the shared decoder. Its sizes,
config.json and spec."""

from __future__ import annotations

from titanlite.models.common.mamba2_args import mamba_split_sizes
from titanlite.models.nemotron_h import args, hf_config
from titanlite.models.spec import HFConfig, ModelSpec

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
    description="Nemotron-H: Mamba-2, attention (no positions) and relu^2 MLP layers, one sublayer each, as "
    "hybrid_override_pattern says",
)
