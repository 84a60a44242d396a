"""GLM-4.5 (Glm4MoeForCausalLM, model_type glm4_moe: GLM-4.5, GLM-4.5-Air, GLM-4.6): the shared MoE decoder with QKV
biases, optional per-head Q/K norms, partial rotary, and after the first dense layers mixtures of sigmoid-routed
experts in groups with a routing bias and shared experts. Its spec (its module is the shared decoder's, which its
arguments' switches and rotary_dim describe); its sizes in args.py, its config.json in hf_config.py, its weight names
in weights.py; its tensor-parallel plan is the shared MoE decoder's. Multi-token prediction is not built
(hf_config.py)."""

from __future__ import annotations

from titanlite.models.common.decoder_spec import moe_decoder_spec
from titanlite.models.glm4_moe import args, hf_config

SPEC = moe_decoder_spec(
    "glm4_moe",
    args.FLAVORS,
    hf_config.read,
    hf_config.write,
    "titanlite.models.glm4_moe.weights",
    "GLM-4.5: QKV biases, per-head Q/K norms, partial rotary; sigmoid-routed experts in groups with a "
    "balancing bias and shared experts, the first layers dense",
    args_type=args.Glm4MoeArgs,
    fields=hf_config.FIELDS,
)
