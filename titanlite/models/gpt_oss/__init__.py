"""gpt-oss (GptOssForCausalLM): the MoE decoder (titanlite/models/moe_decoder) with attention sinks, q/k/v/o biases,
alternating sliding (128) and full layers, YaRN, a biased router (softmax over the top-k logits) and experts with
biases and a clamped SwiGLU. Its sizes (args.py), config.json (hf_config.py) and spec; its module, weight names
and tensor-parallel plan are this folder's, its FLOPs the MoE decoder's."""

from __future__ import annotations

from titanlite.models.common.decoder_args import moe_auxiliary_losses as auxiliary_losses
from titanlite.models.common.decoder_args import moe_split_sizes as split_sizes
from titanlite.models.gpt_oss import args, hf_config
from titanlite.models.spec import HFConfig, ModelSpec

SPEC = ModelSpec(
    name="gpt_oss",
    args_type=args.GptOssArgs,
    flavors=args.FLAVORS,
    model="titanlite.models.gpt_oss.model:GptOss",
    tp_plan="titanlite.models.gpt_oss.parallelize:tp_plan",
    hf_weights="titanlite.models.gpt_oss.weights",
    tp_split_sizes=split_sizes,
    hf=HFConfig(hf_config.MODEL_TYPE, hf_config.read, hf_config.write, experts=True, fields=hf_config.FIELDS),
    moe=lambda a: a.moe,
    with_depth=args.with_depth,
    etp_refusal=lambda a: "experts' down-projection biases (each rank's partial output would add them once more)",
    flops="titanlite.models.common.flops:moe_flops_per_token",
    auxiliary_losses=auxiliary_losses,
    description="gpt-oss: the MoE decoder with attention sinks, q/k/v/o biases, alternating sliding and full "
    "layers, YaRN, a biased router and experts with biases and a clamped SwiGLU",
)
