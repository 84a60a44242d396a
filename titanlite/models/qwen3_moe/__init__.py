"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's decoder whose feed-forwards are mixtures of experts (softmax router,
top-k, optionally renormalised, no shared expert), on the shared MoE decoder (titanlite/models/moe_decoder). Its
sizes (a tiny debug model and Qwen3-30B-A3B), its config.json both ways and its spec.

The config.json: Qwen3's decoder fields (the Llama decoder's, per-head Q/K norms) plus the mixture-of-experts
fields, each honoured or refused in one line: num_experts (transformers 5 writes num_local_experts),
num_experts_per_tok, moe_intermediate_size, norm_topk_prob, router_aux_loss_coef, decoder_sparse_step and
mlp_only_layers (the dense layers). Ignored, as they change no math: output_router_logits (whether transformers
returns the router logits) and max_window_layers. Qwen3-MoE has no shared expert: a
shared_expert_intermediate_size is refused."""

from __future__ import annotations

from titanlite.base.errors import ConfigError
from titanlite.base.hf_config import refuse
from titanlite.models.common.decoder_args import DEBUG_SIZES, MoEDecoderArgs
from titanlite.models.common.decoder_config import (
    DecoderConfig,
    Expressible,
    attention_biases,
    no_mlp_bias,
    window_always,
    window_fields,
)
from titanlite.models.common.decoder_spec import moe_decoder_spec
from titanlite.models.common.moe.args import MoEArgs, dense_layers_from_hf
from titanlite.models.common.moe.hf_config import (
    MOE_FIELDS,
    QWEN_MOE_FIELDS,
    block_from_config,
    check_expressible,
    with_moe,
)


def _qwen3_moe_30b_a3b() -> MoEDecoderArgs:
    """Qwen/Qwen3-30B-A3B: 48 layers, every one sparse (128 experts, 8 per token, 768 wide), untied."""
    return MoEDecoderArgs(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        ffn_dim=6144,
        vocab_size=151936,
        max_seq_len=40960,
        rope_theta=1e6,
        norm_eps=1e-6,
        tie_embeddings=False,
        head_dim=128,
        qk_norm="head",
        moe=MoEArgs(n_experts=128, top_k=8, expert_dim=768, norm_topk_prob=True, aux_loss_coef=0.001),
        family="qwen3_moe",
    )


# vocab_size 0: the tokenizer's, padded to a multiple of 64.
FLAVORS = {
    # dim 64, 4 layers (layer 1 dense, as mlp_only_layers=[1]), 8 experts of width 32, 2 per token.
    "debug": MoEDecoderArgs(
        **DEBUG_SIZES,
        head_dim=32,
        qk_norm="head",
        family="qwen3_moe",
    ),
    "qwen3_moe_30b_a3b": _qwen3_moe_30b_a3b(),
}


def _switches(config: dict, n_layers: int, where: str) -> dict:
    no_mlp_bias("qwen3_moe", config, where)
    return attention_biases(config, n_layers, where) | {"qk_norm": "head"}


DECODER = DecoderConfig(
    family="qwen3_moe",
    model_type="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    expressible=Expressible(mlp_bias=False, qk_norm="head"),
    switches=_switches,
    window=window_always,
    fields=window_fields,
)


def moe_from_config(config: dict, n_layers: int, where: str) -> MoEArgs:
    """The MoE block of a qwen3_moe config.json (absent keys take Qwen3MoeConfig's defaults)."""
    # Qwen's folders count the experts in num_experts; transformers 5 writes num_local_experts.
    experts_key = "num_experts" if "num_experts" in config or "num_local_experts" not in config else "num_local_experts"
    n_experts = config.get(experts_key, 128)
    if not n_experts:
        raise refuse(where, experts_key, n_experts, "a model without experts is a qwen3 model (model_type qwen3)")
    if config.get("shared_expert_intermediate_size"):
        raise refuse(
            where,
            "shared_expert_intermediate_size",
            config["shared_expert_intermediate_size"],
            "qwen3_moe has no shared expert",
        )
    try:
        sparse_step = config.get("decoder_sparse_step", 1)
        dense = dense_layers_from_hf(n_layers, config.get("mlp_only_layers") or [], sparse_step)
    except ValueError as e:
        raise ConfigError(f"{where} is not supported: {e}") from e
    return block_from_config(
        where,
        config,
        {"n_experts": experts_key},
        n_experts=n_experts,
        top_k=config.get("num_experts_per_tok", 8),
        expert_dim=config.get("moe_intermediate_size", 768),
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        aux_loss_coef=config.get("router_aux_loss_coef", 0.001),
        dense_layers=dense,
    )


def read(config: dict, where: str) -> MoEDecoderArgs:
    base = DECODER.read(config, where)
    return with_moe(base, moe_from_config(config, base.n_layers, where))


def write(args: MoEDecoderArgs) -> dict:
    moe = args.moe
    check_expressible(moe, "qwen3_moe")
    return DECODER.write(args) | {
        "num_experts": moe.n_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.expert_dim,
        "norm_topk_prob": moe.norm_topk_prob,
        "router_aux_loss_coef": moe.aux_loss_coef if moe.balance == "aux_loss" else 0.0,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(moe.dense_layers),
        "output_router_logits": False,
    }


SPEC = moe_decoder_spec(
    "qwen3_moe", FLAVORS, read, write, "titanlite.models.qwen3_moe.weights",
    "Qwen3-MoE: Qwen3's decoder with mixture-of-experts feed-forwards (top-k of softmax, no shared expert)",
    fields={**MOE_FIELDS, **QWEN_MOE_FIELDS},  # beyond the shared fields: the experts', in Qwen's names
)  # fmt: skip
