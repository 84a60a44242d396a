"""GLM-4.5 (Glm4MoeForCausalLM, model_type glm4_moe: GLM-4.5, GLM-4.5-Air, GLM-4.6): the shared MoE decoder with QKV
biases, optional per-head Q/K norms, partial rotary, and after the first dense layers mixtures of sigmoid-routed
experts in groups with a routing bias and shared experts. Its spec (its module is the shared decoder's, which its
arguments' switches and rotary_dim describe); its sizes in args.py, its config.json in hf_config.py, its weight names
in weights.py, its tensor-parallel plan (the shared MoE one) in parallelize.py. Multi-token prediction is not built
(hf_config.py)."""

from __future__ import annotations

from titanlite.models.common.decoder_args import moe_auxiliary_losses, moe_split_sizes, moe_with_depth
from titanlite.models.glm4_moe import args, hf_config
from titanlite.models.spec import HFConfig, ModelSpec

SPEC = ModelSpec(
    name="glm4_moe",
    args_type=args.Glm4MoeArgs,
    flavors=args.FLAVORS,
    model="titanlite.models.common.decoder:Transformer",
    tp_plan="titanlite.models.glm4_moe.parallelize:tp_plan",
    hf_weights="titanlite.models.glm4_moe.weights",
    tp_split_sizes=moe_split_sizes,
    hf=HFConfig(hf_config.MODEL_TYPE, hf_config.read, hf_config.write, experts=True),
    moe=lambda a: a.moe,
    with_depth=moe_with_depth,
    flops="titanlite.models.common.flops:moe_flops_per_token",
    auxiliary_losses=moe_auxiliary_losses,
    description="GLM-4.5: QKV biases, per-head Q/K norms, partial rotary; sigmoid-routed experts in groups with a "
    "balancing bias and shared experts, the first layers dense",
)
