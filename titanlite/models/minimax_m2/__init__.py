"""MiniMax-M2 (MiniMaxM2ForCausalLM; MiniMaxAI/MiniMax-M2, 230B total, about 10B active): the shared MoE decoder with
an RMSNorm over each token's whole query and key projection (qk_norm "full", as OLMo 2's), rotations of the leading
rotary_dim channels of each head, and on every layer a mixture of sigmoid-routed experts chosen with a routing bias
(DeepSeek-V3's routing, without groups, shared experts or scaling). Its spec; its sizes args.py, its config.json
hf_config.py, its weight names weights.py; its module is the shared decoder's (its arguments' switches and rotary_dim
describe it) and its tensor-parallel plan the shared MoE decoder's (titanlite/models/common/parallelize.py: the
whole-projection norms sharded with the heads, their sum of squares all-reduced)."""

from __future__ import annotations

from titanlite.models.common.decoder_spec import moe_decoder_spec
from titanlite.models.minimax_m2 import args, hf_config

SPEC = moe_decoder_spec(
    "minimax_m2",
    args.FLAVORS,
    hf_config.read,
    hf_config.write,
    "titanlite.models.minimax_m2.weights",
    "MiniMax-M2: the MoE decoder with whole-projection Q/K norms, partial rotary and sigmoid routing "
    "with a routing bias, 256 experts top-8",
    args_type=args.MiniMaxM2Args,
    fields=hf_config.FIELDS,
)
