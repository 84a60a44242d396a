"""Qwen3-Next's config.json both ways (model_type "qwen3_next", Qwen3NextForCausalLM), torch-free: Qwen3.5's text fields
(titanlite/models/common/qwen_hybrid/hf_config.py reads and writes them) and the mixture of experts'. Every field that
changes the math is honoured or refused in one line naming it; an absent key takes Qwen3NextConfig's default."""

from __future__ import annotations

from titanlite.base.errors import ConfigError
from titanlite.base.hf_config import refuse
from titanlite.models.common.moe.args import MoEArgs, dense_layers_from_hf
from titanlite.models.common.moe.hf_config import FIXED, block_from_config, check_expressible
from titanlite.models.common.qwen_hybrid import hf_config as hybrid
from titanlite.models.qwen3_next.args import Qwen3NextArgs

MODEL_TYPE, ARCHITECTURE = "qwen3_next", "Qwen3NextForCausalLM"
FIELDS = hybrid.EXPERT_FIELDS  # the config.json fields it reads beyond the shared ones: Qwen3.5-MoE's
# Qwen3NextConfig's defaults (transformers 5) of the fields Qwen3.5's reader requires or defaults otherwise. They are
# not all Qwen3-Next-80B-A3B's: its config.json sets intermediate_size 5120, max_position_embeddings 262144 and
# rope_theta 1e7.
DEFAULTS = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "max_position_embeddings": 32768,
    "rope_theta": 10000.0,
}
# What a qwen3_next config.json fixes about the MoE block: the shared decoder's softmax-routed families' fixes, except
# that the shared expert is there and gated (its width is shared_expert_intermediate_size).
MOE_FIXED = {k: v for k, v in FIXED.items() if k not in ("n_shared_experts", "shared_expert_dim")} | {
    "shared_gate": True
}


def _moe(config: dict, n_layers: int, where: str) -> MoEArgs:
    n_experts = config.get("num_experts", 512)
    if n_experts < 1:
        raise refuse(where, "num_experts", n_experts, "titanlite builds Qwen3-Next with mixtures of experts only")
    shared = config.get("shared_expert_intermediate_size", 512)
    if shared < 1:
        raise refuse(where, "shared_expert_intermediate_size", shared, "Qwen3-Next's blocks have a gated shared expert")
    only, step = config.get("mlp_only_layers") or [], config.get("decoder_sparse_step", 1)
    try:
        dense = dense_layers_from_hf(n_layers, only, step)
    except ValueError as e:
        raise ConfigError(f"{where} is not supported: {e}") from e
    return block_from_config(
        where,
        config,
        {"n_experts": "num_experts", "shared_expert_dim": "shared_expert_intermediate_size"},
        n_experts=n_experts,
        top_k=config.get("num_experts_per_tok", 10),
        expert_dim=config.get("moe_intermediate_size", 512),
        norm_topk_prob=bool(config.get("norm_topk_prob", True)),
        shared_expert_dim=shared,
        shared_gate=True,
        aux_loss_coef=config.get("router_aux_loss_coef", 0.001),
        dense_layers=dense,
    )


def read(config: dict, where: str) -> Qwen3NextArgs:
    """Qwen3NextArgs of a qwen3_next config.json."""
    config = DEFAULTS | config
    fields = hybrid.read_fields(config, where) | {"ffn_dim": config["intermediate_size"]}
    return Qwen3NextArgs(**fields, moe=_moe(config, fields["n_layers"], where))


def write(args: Qwen3NextArgs) -> dict:
    """The qwen3_next config.json fields of this model."""
    m = args.moe
    more = () if m.shared_hidden else ("no shared expert",)
    check_expressible(m, MODEL_TYPE, fixed=MOE_FIXED, more=more)
    # The hybrid decoder's text fields (the decoder's, the dense MLP's width, the linear layers', the rotations).
    return hybrid.write_fields(args, ARCHITECTURE, MODEL_TYPE) | {
        "num_experts": m.n_experts,
        "num_experts_per_tok": m.top_k,
        "moe_intermediate_size": m.expert_dim,
        "shared_expert_intermediate_size": m.shared_hidden,
        "norm_topk_prob": m.norm_topk_prob,
        "router_aux_loss_coef": m.aux_loss_coef if m.balance == "aux_loss" else 0.0,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(m.dense_layers),
        "output_router_logits": False,
    }
