"""DeepSeek-V3's config.json (model_type deepseek_v3, DeepseekV3ForCausalLM) both ways, torch-free. Every field that
changes the math is honoured or refused in one line naming it.

Honoured: the decoder's sizes, q_lora_rank (null: one q_proj), kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
v_head_dim, rope_theta and rope_scaling / rope_parameters (plain, "yarn", Llama 3.1's "llama3"), rope_interleave,
n_routed_experts, num_experts_per_tok, moe_intermediate_size, n_shared_experts, routed_scaling_factor,
norm_topk_prob, n_group, topk_group, first_k_dense_replace. Refused: scoring_func other than "sigmoid" (transformers'
DeepseekV3 and DeepSeek's own code score with sigmoid only), topk_method other than "noaux_tc" (or "greedy" where
no group limit applies, which is the same routing), moe_layer_freq other than 1, attention_bias, a
num_key_value_heads other than the heads (every head has its own key), hidden_act other than silu. The published
weights' FP8 blocks are dequantized as they are read (titanlite/components/hf_quantized.py). Multi-token prediction
(num_nextn_predict_layers) is honoured: mtp_layers, those layers loaded and trained where the folder holds them
(titanlite/models/hf_config.py held_mtp_layers; model.mtp_layers = 0 leaves them out of the run and carries them
unchanged into an export).
Ignored, as they change no math: aux_loss_alpha and seq_aux (DeepSeek's training loss), ep_size, output_router_logits,
pretraining_tp, initializer_range, attention_dropout (0), use_cache."""

from __future__ import annotations

from titanlite.base.errors import ConfigError
from titanlite.base.hf_config import COUNT, FLAG, TEXT, WHOLE, FieldTypes, refuse
from titanlite.models.common.decoder_config import decoder_fields, rope_scaling_to_hf, rope_settings
from titanlite.models.common.latent.hf_config import (
    LATENT_FIELDS,
    LATENT_KEYS,
    LATENT_OMITS,
    latent_from_config,
    latent_to_config,
)
from titanlite.models.common.moe.args import MoEArgs
from titanlite.models.common.moe.hf_config import (
    BIAS_ROUTED_FIELDS,
    MOE_FIELDS,
    bias_routed_config,
    block_from_config,
    in_config_names,
)
from titanlite.models.common.rope_args import YarnRopeScaling
from titanlite.models.deepseek_v3.args import DeepseekV3Args, first_dense

# The config.json fields DeepSeek-V3 reads beyond the shared ones (titanlite/base/hf_config.py FIELDS): the experts'
# and their routing, latent attention's, the interleaved rotary channels, multi-token prediction's.
FIELDS: FieldTypes = {
    **MOE_FIELDS,
    **BIAS_ROUTED_FIELDS,
    **LATENT_FIELDS,
    "moe_layer_freq": (COUNT, False),
    "scoring_func": (TEXT, False),
    "topk_method": (TEXT, False),
    "rope_interleave": (FLAG, False),
    "num_nextn_predict_layers": (WHOLE, True),
    "num_mtp_layers": (WHOLE, True),
}

MODEL_TYPE = "deepseek_v3"
ARCHITECTURE = "DeepseekV3ForCausalLM"


def _mtp_layers(config: dict) -> int:
    return config.get("num_nextn_predict_layers", config.get("num_mtp_layers", 0)) or 0


def _check_routing(config: dict, where: str, n_group: int, topk_group: int) -> None:
    scoring = config.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise refuse(
            where, "scoring_func", scoring, "DeepSeek-V3 scores experts with a sigmoid (transformers' DeepseekV3 "
            "and DeepSeek's code compute no other); a softmax router is DeepSeek-V2's (model_type deepseek_v2)",
        )  # fmt: skip
    method = config.get("topk_method", "noaux_tc")
    limited = topk_group < n_group
    if method not in ("noaux_tc", "greedy") or (method == "greedy" and limited):
        raise refuse(
            where, "topk_method", method, "titanlite routes as 'noaux_tc' (group-limited top-k of the sigmoid "
            "scores plus the correction bias), and as 'greedy' only where no group limit applies",
        )  # fmt: skip
    if config.get("moe_layer_freq", 1) != 1:
        raise refuse(where, "moe_layer_freq", config["moe_layer_freq"], "every layer after the dense ones is sparse")


def _moe(config: dict, where: str, n_layers: int) -> MoEArgs:
    # Absent: DeepseekV3Config's 8 and 4; null: no groups.
    n_group, topk_group = config.get("n_group", 8) or 1, config.get("topk_group", 4) or 1
    _check_routing(config, where, n_group, topk_group)
    n_experts = config.get("n_routed_experts", config.get("num_local_experts", 256))
    top_k = config.get("num_experts_per_tok", 8)
    if top_k > n_experts:
        raise refuse(where, "num_experts_per_tok", top_k, f"it exceeds n_routed_experts={n_experts}")
    dense = config.get("first_k_dense_replace", 3) or 0
    if dense > n_layers:
        raise refuse(where, "first_k_dense_replace", dense, f"the model has {n_layers} layers")
    return block_from_config(
        where,
        config,
        {"n_experts": "n_routed_experts"},
        n_experts=n_experts,
        top_k=top_k,
        expert_dim=config.get("moe_intermediate_size", 2048),
        score_func="sigmoid",
        norm_topk_prob=bool(config.get("norm_topk_prob", True)),
        route_scale=float(config.get("routed_scaling_factor", 2.5)),
        n_shared_experts=config.get("n_shared_experts", 1) or 0,
        balance="bias",
        n_groups=n_group,
        topk_groups=topk_group,
        dense_layers=first_dense(dense),
    )


def _attention(config: dict, where: str) -> dict:
    n_heads = config["num_attention_heads"]
    latent = latent_from_config(config, where, "DeepSeek-V3", n_heads, q_lora_rank=1536)
    return {"n_heads": n_heads, **latent, "rope_interleave": bool(config.get("rope_interleave", True))}


def read(config: dict, where: str) -> DeepseekV3Args:
    """DeepseekV3Args of a deepseek_v3 config.json (absent keys take DeepseekV3Config's defaults)."""
    return read_as(DeepseekV3Args, config, where)


def read_as(args_type: type, config: dict, where: str, interleave: bool | None = None, **more):
    """`args_type` (DeepseekV3Args or a subclass) of a config.json in DeepSeek-V3's fields, with `more` of its own;
    `interleave`: how the folder lays out its rotary rows where the family has one layout whatever config.json says
    (None: its rope_interleave)."""
    if config.get("hidden_act", "silu") != "silu":
        raise refuse(where, "hidden_act", config["hidden_act"], "the MLPs are SwiGLU (silu)")
    n_layers = config.get("num_hidden_layers", 61)
    rope_theta, rope_scaling = rope_settings(config, where)
    if rope_scaling is not None and not isinstance(rope_scaling, YarnRopeScaling):
        raise refuse(where, "rope_type", "llama3", "DeepSeek-V3 reads plain RoPE or 'yarn'")
    mtp = _mtp_layers(config)  # the folder's weights may hold fewer (models/hf_config.py held_mtp_layers)
    moe, attention = _moe(config, where, n_layers), _attention(config, where)
    if interleave is not None:
        attention["rope_interleave"] = interleave
    try:
        return args_type(
            dim=config.get("hidden_size", 7168),
            n_layers=n_layers,
            ffn_dim=config.get("intermediate_size", 18432),
            vocab_size=config.get("vocab_size", 129280),
            max_seq_len=config.get("max_position_embeddings", 4096),
            rope_theta=rope_theta,
            norm_eps=config.get("rms_norm_eps", 1e-6),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            rope_scaling=rope_scaling,
            moe=moe,
            mtp_layers=mtp,
            **attention,
            **more,
        )
    except ValueError as e:  # the latent attention's widths, which config.json names as DeepseekV3Args does
        raise ConfigError(f"{where} is not supported: {in_config_names(str(e), LATENT_KEYS)}") from e


def write(args: DeepseekV3Args) -> dict:
    """DeepSeek-V3's config.json; what it cannot say is refused, naming the field (transformers' DeepseekV3 would
    compute another model): a block other than DeepSeek's (moe/hf_config.py bias_routed_config), dense layers other
    than the first ones, an indexer (DeepSeek-V3.2's, model_type deepseek_v32)."""
    if args.indexer is not None:
        raise ConfigError("a deepseek_v3 config.json cannot express an indexer; export it as model deepseek_v32")
    return {**write_as(args, ARCHITECTURE, MODEL_TYPE, "deepseek_v3"), "rope_interleave": args.rope_interleave}


def write_as(args: DeepseekV3Args, architecture: str, model_type: str, family: str) -> dict:
    """The config.json fields DeepSeek-V3's reader takes, for `model_type` (`family`: how refusals name it)."""
    moe = bias_routed_config(args.moe, family)
    rope = rope_scaling_to_hf(args.rope_scaling)
    return {
        **decoder_fields(args, architecture, model_type, omit=LATENT_OMITS),
        "rope_theta": args.rope_theta,
        "rope_parameters": {"rope_theta": args.rope_theta, **rope},
        "rope_scaling": rope if args.rope_scaling else None,
        **latent_to_config(args),
        **moe,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "num_nextn_predict_layers": args.mtp_layers,
    }
