"""OLMoE (OlmoeForCausalLM): the MoE decoder (titanlite/models/moe_decoder) with RMSNorms over each token's whole
query and key projections, 64 experts of which 8 per token, the top-k not renormalised, no dense layer; the
experts' width is config.json's intermediate_size. Its sizes, its config.json and its spec."""

from __future__ import annotations

from titanlite.base.hf_config import NUMBER, refuse
from titanlite.models.common.decoder_args import MoEDecoderArgs, sizes
from titanlite.models.common.decoder_config import DecoderConfig, Expressible, attention_biases, no_mlp_bias
from titanlite.models.common.decoder_spec import moe_decoder_spec
from titanlite.models.common.moe.args import MoEArgs
from titanlite.models.common.moe.hf_config import MOE_FIELDS, block_from_config, check_expressible, with_moe


def _olmoe(dim, n_layers, n_heads, n_experts, top_k, expert_dim, vocab_size=50304, max_seq_len=4096):
    return MoEDecoderArgs(
        **sizes(dim, n_layers, n_heads, n_heads, expert_dim),
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        rope_theta=10000.0,
        norm_eps=1e-5,
        qk_norm="full",
        family="olmoe",
        moe=MoEArgs(n_experts=n_experts, top_k=top_k, expert_dim=expert_dim, aux_loss_coef=0.01),
    )


FLAVORS = {
    "debug": _olmoe(64, 4, 4, 8, 2, 32, vocab_size=0, max_seq_len=2048),
    # allenai/OLMoE-1B-7B-0924: 16 layers, 64 experts of width 1024, 8 per token, untied, 50,304 ids.
    "olmoe_1b_7b": _olmoe(2048, 16, 16, 64, 8, 1024),
}


def switches(config: dict, n_layers: int, where: str) -> dict:
    no_mlp_bias("olmoe", config, where)
    if config.get("clip_qkv"):
        raise refuse(where, "clip_qkv", config["clip_qkv"], "olmoe's queries, keys and values are not clipped here")
    return attention_biases(config, n_layers, where) | {"qk_norm": "full"}


DECODER = DecoderConfig(
    family="olmoe",
    model_type="olmoe",
    architecture="OlmoeForCausalLM",
    expressible=Expressible(mlp_bias=False, qk_norm="full"),
    switches=switches,
)


def read(config: dict, where: str) -> MoEDecoderArgs:
    base = DECODER.read(config, where)
    moe = block_from_config(
        where,
        config,
        {"n_experts": "num_experts", "expert_dim": "intermediate_size"},
        n_experts=config.get("num_experts", 64),
        top_k=config.get("num_experts_per_tok", 8),
        expert_dim=base.ffn_dim,
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        aux_loss_coef=config.get("router_aux_loss_coef", 0.01),
    )
    return with_moe(base, moe)


def write(args: MoEDecoderArgs) -> dict:
    moe = args.moe
    check_expressible(moe, "olmoe", dense_layers=False)
    return DECODER.write(args) | {
        "intermediate_size": moe.expert_dim,
        "num_experts": moe.n_experts,
        "num_experts_per_tok": moe.top_k,
        "norm_topk_prob": moe.norm_topk_prob,
        "router_aux_loss_coef": moe.aux_loss_coef if moe.balance == "aux_loss" else 0.0,
        "output_router_logits": False,
        "clip_qkv": None,
    }


SPEC = moe_decoder_spec(
    "olmoe", FLAVORS, read, write, "titanlite.models.olmoe.weights",
    "OLMoE: the MoE decoder with whole-projection Q/K norms, 64 experts top-8",
    fields={**MOE_FIELDS, "clip_qkv": (NUMBER, True)},  # beyond the shared fields: the experts', clip_qkv
)  # fmt: skip
