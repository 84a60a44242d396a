"""MiniMax-M2 (MiniMaxM2ForCausalLM; MiniMaxAI/MiniMax-M2, 230B total, about 10B active): the shared MoE decoder with
an RMSNorm over each token's whole query and key projection (qk_norm "full", as OLMo 2's), rotations of the leading
rotary_dim channels of each head, and on every layer a mixture of sigmoid-routed experts chosen with a routing bias
(DeepSeek-V3's routing, without groups, shared experts or scaling). Its spec; its sizes args.py, its config.json
hf_config.py, its weight names weights.py; its module is the shared decoder's (its arguments' switches and rotary_dim
describe it) and its tensor-parallel plan the shared MoE decoder's (titanlite/models/common/parallelize.py: the
whole-projection norms sharded with the heads, their sum of squares all-reduced)."""

from __future__ import annotations

from titanlite.models.common.decoder_args import moe_auxiliary_losses, moe_split_sizes, moe_with_depth
from titanlite.models.minimax_m2 import args, hf_config
from titanlite.models.spec import HFConfig, ModelSpec

SPEC = ModelSpec(
    name="minimax_m2",
    args_type=args.MiniMaxM2Args,
    flavors=args.FLAVORS,
    model="titanlite.models.common.decoder:Transformer",
    tp_plan="titanlite.models.common.parallelize:moe_tp_plan",
    hf_weights="titanlite.models.minimax_m2.weights",
    tp_split_sizes=moe_split_sizes,
    hf=HFConfig(hf_config.MODEL_TYPE, hf_config.read, hf_config.write, experts=True),
    moe=lambda a: a.moe,
    with_depth=moe_with_depth,
    flops="titanlite.models.common.flops:moe_flops_per_token",
    auxiliary_losses=moe_auxiliary_losses,
    description="MiniMax-M2: the MoE decoder with whole-projection Q/K norms, partial rotary and sigmoid routing "
    "with a routing bias, 256 experts top-8",
)
