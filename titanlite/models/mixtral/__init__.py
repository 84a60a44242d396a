"""Mixtral (MixtralForCausalLM): the MoE decoder (titanlite/models/moe_decoder) with the Llama decoder as it is
(no Q/K norms), 8 experts of which 2 per token, the top-2 renormalised, no dense layer; the experts' width is
config.json's intermediate_size; a sliding window on every layer, as Mistral's. Its sizes, its config.json and its
spec."""

from __future__ import annotations

from titanlite.base.hf_config import refuse
from titanlite.models.common.decoder_args import MoEDecoderArgs, sizes
from titanlite.models.common.decoder_config import (
    DecoderConfig,
    Expressible,
    attention_biases,
    no_mlp_bias,
    window_always,
)
from titanlite.models.common.decoder_spec import moe_decoder_spec
from titanlite.models.common.moe.args import MoEArgs
from titanlite.models.common.moe.hf_config import block_from_config, check_expressible, with_moe


def _mixtral(dim, n_layers, n_heads, n_kv_heads, expert_dim, vocab_size=32000, max_seq_len=32768):
    return MoEDecoderArgs(
        **sizes(dim, n_layers, n_heads, n_kv_heads, expert_dim),
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        rope_theta=1e6,
        norm_eps=1e-5,
        family="mixtral",
        moe=MoEArgs(n_experts=8, top_k=2, expert_dim=expert_dim, norm_topk_prob=True, aux_loss_coef=0.001),
    )


FLAVORS = {
    "debug": _mixtral(64, 4, 4, 2, 32, vocab_size=0, max_seq_len=2048),
    # mistralai/Mixtral-8x7B-v0.1: 32 layers, 8 experts of width 14336, 2 per token, untied, 32,000 ids.
    "mixtral_8x7b": _mixtral(4096, 32, 32, 8, 14336),
}


def switches(config: dict, n_layers: int, where: str) -> dict:
    no_mlp_bias("mixtral", config, where)  # router_jitter_noise: a training run refuses it (check_training_fields)
    return attention_biases(config, n_layers, where)


DECODER = DecoderConfig(
    family="mixtral",
    model_type="mixtral",
    architecture="MixtralForCausalLM",
    expressible=Expressible(qkv_bias=False, out_bias=False, mlp_bias=False),
    switches=switches,
    window=window_always,
    fields=lambda args: {"sliding_window": args.sliding_window or None},
    attention_bias_field=False,
)


def read(config: dict, where: str) -> MoEDecoderArgs:
    base = DECODER.read(config, where)
    moe = block_from_config(
        where,
        config,
        {"n_experts": "num_local_experts", "expert_dim": "intermediate_size"},
        n_experts=config.get("num_local_experts", 8),
        top_k=config.get("num_experts_per_tok", 2),
        expert_dim=base.ffn_dim,
        norm_topk_prob=True,  # Mixtral always renormalises its top-k
        aux_loss_coef=config.get("router_aux_loss_coef", 0.001),
    )
    return with_moe(base, moe)


def write(args: MoEDecoderArgs) -> dict:
    moe = args.moe
    check_expressible(moe, "mixtral", dense_layers=False)
    if not moe.norm_topk_prob:
        raise refuse("a mixtral config.json", "MoEArgs.norm_topk_prob", False, "Mixtral always renormalises")
    return DECODER.write(args) | {
        "intermediate_size": moe.expert_dim,
        "num_local_experts": moe.n_experts,
        "num_experts_per_tok": moe.top_k,
        "router_aux_loss_coef": moe.aux_loss_coef if moe.balance == "aux_loss" else 0.0,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
    }


SPEC = moe_decoder_spec(
    "mixtral", FLAVORS, read, write, "titanlite.models.mixtral.weights",
    "Mixtral: the MoE decoder on the Llama decoder as it is, 8 experts top-2",
)  # fmt: skip
