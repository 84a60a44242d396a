"""Gemma 4's text config.json both ways, torch-free: model_type "gemma4_text" (Gemma4ForCausalLM) and the published
multimodal folders' "gemma4" (Gemma4ForConditionalGeneration), whose text_config is read and whose vision and audio
towers are carried (titanlite/models/gemma4/weights.py). The full layers' head width and key/value heads come as
global_head_dim and num_global_key_value_heads (the published form) or as transformers 5's per_layer_config.

Every field that changes the text model's math is honoured or refused in one line naming it. Read and not math:
initializer_range, use_cache, pad/bos/eos_token_id; use_bidirectional_attention "vision" (it changes image tokens'
attention only, which the text model never sees; "all" is refused); attention_dropout is the training checks'."""

from __future__ import annotations

from titanlite.base.hf_config import COUNT, FLAG, NUMBER, OBJECT, TEXT, WHOLE, FieldTypes, check_types, refuse
from titanlite.models.common.decoder_config import attention_shape, decoder_fields, layer_types_of
from titanlite.models.common.moe.args import MoEArgs
from titanlite.models.common.moe.hf_config import MOE_FIELDS, check_expressible
from titanlite.models.gemma4.args import Gemma4Args, layer_types

MODEL_TYPE = "gemma4_text"
MULTIMODAL = "gemma4"
ACTIVATION = "gelu_pytorch_tanh"
KINDS = ("full_attention", "sliding_attention")
# The config.json fields Gemma 4 reads beyond the shared ones (titanlite/base/hf_config.py FIELDS): Gemma's, the
# multimodal folder's text_config, the full layers' heads, keys equal to values, per-layer embeddings, shared keys
# and values, experts.
FIELDS: FieldTypes = {
    **MOE_FIELDS,
    "hidden_activation": (TEXT, True),
    "final_logit_softcapping": (NUMBER, True),
    "attn_logit_softcapping": (NUMBER, True),
    "use_bidirectional_attention": (FLAG, True),
    "text_config": (OBJECT, False),
    "global_head_dim": (COUNT, False),
    "num_global_key_value_heads": (COUNT, True),
    "per_layer_config": (OBJECT, True),
    "attention_k_eq_v": (FLAG, False),
    "hidden_size_per_layer_input": (WHOLE, True),
    "vocab_size_per_layer_input": (COUNT, False),
    "num_kv_shared_layers": (WHOLE, False),
    "use_double_wide_mlp": (FLAG, False),
    "enable_moe_block": (FLAG, False),
    "top_k_experts": (COUNT, True),
}

# Null in every dense model's config.json transformers writes: no experts.
NULLABLE = ("moe_intermediate_size",)


def text_config(config: dict, where: str) -> tuple[dict, str]:
    """The text model's fields (a multimodal folder's text_config, its tie_word_embeddings taken from the top level
    where the text_config has none) and where they are, for the refusals."""
    if config.get("model_type") != MULTIMODAL:
        return config, where
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise refuse(where, "text_config", text, "a gemma4 config.json holds the text model there")
    where = f"{where} text_config"
    check_types({k: v for k, v in text.items() if k != "use_bidirectional_attention"}, where, FIELDS, NULLABLE)
    return {"tie_word_embeddings": config.get("tie_word_embeddings", True), **text}, where


def _refuse_unused(config: dict, where: str) -> None:
    if config.get("use_bidirectional_attention") not in (None, "vision"):
        value = config["use_bidirectional_attention"]
        raise refuse(where, "use_bidirectional_attention", value, "titanlite's text attention is causal")
    if config.get("hidden_activation", ACTIVATION) != ACTIVATION:
        raise refuse(where, "hidden_activation", config["hidden_activation"], f"Gemma 4's MLPs are {ACTIVATION!r}")
    if config.get("attn_logit_softcapping") is not None:
        raise refuse(where, "attn_logit_softcapping", config["attn_logit_softcapping"], "Gemma 4 has none")


def _rope(config: dict, where: str) -> dict:
    """rope_theta, rope_local_theta, rotary_fraction and rope_factor of rope_parameters (one object per layer kind);
    transformers' defaults where it gives none."""
    params = config.get("rope_parameters") or {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
    }
    if set(params) - set(KINDS):
        key = sorted(set(params) - set(KINDS))[0]
        raise refuse(where, "rope_parameters", key, "Gemma 4 keys its rotary settings by layer kind")
    full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    local_type = local.get("rope_type", "default")
    if local_type != "default":
        raise refuse(where, "rope_parameters sliding_attention rope_type", local_type, "the sliding layers' is default")
    extra = sorted(set(local) - {"rope_type", "rope_theta"})
    if extra:
        raise refuse(where, f"rope_parameters sliding_attention {extra[0]}", local[extra[0]], "default RoPE takes none")
    full_type = full.get("rope_type", "default")
    if full_type not in ("default", "proportional"):
        raise refuse(where, "rope_parameters full_attention rope_type", full_type, "use default or proportional")
    allowed = {"rope_type", "rope_theta"} | (
        {"partial_rotary_factor", "factor"} if full_type == "proportional" else set()
    )
    extra = sorted(set(full) - allowed)
    if extra:
        raise refuse(
            where, f"rope_parameters full_attention {extra[0]}", full[extra[0]], f"{full_type} RoPE takes none"
        )
    return {
        "rope_theta": float(full.get("rope_theta", 1e6)),
        "rope_local_theta": float(local.get("rope_theta", 10000.0)),
        "rotary_fraction": float(full.get("partial_rotary_factor", 1.0)),
        "rope_factor": float(full.get("factor", 1.0)),
    }


def _full_heads(config: dict, where: str, kinds: tuple[str, ...], n_kv_heads: int, k_eq_v: bool) -> tuple[int, int]:
    """(global_head_dim, n_global_kv_heads) from global_head_dim / num_global_key_value_heads (the latter counted
    only with attention_k_eq_v, as transformers does), or from per_layer_config (every full layer the same, none
    for the sliding ones)."""
    per_layer = config.get("per_layer_config")
    if per_layer is None:
        heads = config.get("num_global_key_value_heads") if k_eq_v else None
        return config.get("global_head_dim", 512), heads or n_kv_heads
    if not isinstance(per_layer, dict):
        raise refuse(where, "per_layer_config", per_layer, "it maps layer indices to their overrides")
    overrides = {int(layer): dict(value) for layer, value in per_layer.items()}
    full = [overrides.get(i) for i, kind in enumerate(kinds) if kind == "full_attention"]
    sliding = [i for i, kind in enumerate(kinds) if kind != "full_attention" and overrides.get(i)]
    if sliding or any(o != full[0] for o in full) or set(full[0] or {}) - {"head_dim", "num_key_value_heads"}:
        raise refuse(where, "per_layer_config", per_layer, "titanlite builds one head shape per layer kind")
    shape = full[0] or {}
    return shape.get("head_dim", config.get("head_dim", 256)), shape.get("num_key_value_heads", n_kv_heads)


def _moe(config: dict, where: str) -> MoEArgs | None:
    if not config.get("enable_moe_block"):
        for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
            if config.get(key):
                raise refuse(where, key, config[key], "it takes enable_moe_block = true")
        return None
    for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
        if not config.get(key):
            raise refuse(where, key, config.get(key), "enable_moe_block needs it")
    try:
        return MoEArgs(
            n_experts=config["num_experts"],
            top_k=config["top_k_experts"],
            expert_dim=config["moe_intermediate_size"],
            norm_topk_prob=True,
        )
    except ValueError as e:
        raise refuse(where, "top_k_experts", config["top_k_experts"], str(e)) from None


def read(config: dict, where: str) -> Gemma4Args:
    """Gemma4Args of a gemma4_text config.json, or of a gemma4 (multimodal) one's text_config."""
    config, where = text_config(config, where)
    _refuse_unused(config, where)
    # transformers' defaults for the shape fields a config.json may leave out
    dim, n_heads, n_kv_heads, head_dim = attention_shape({"head_dim": 256, "num_key_value_heads": 4, **config}, where)
    n_layers = config["num_hidden_layers"]
    kinds = tuple(layer_types_of(config, where)) or layer_types(n_layers)
    if len(kinds) != n_layers:
        raise refuse(where, "layer_types", f"[{len(kinds)} entries]", f"it needs one per layer ({n_layers})")
    if kinds[-1] != "full_attention":
        raise refuse(
            where,
            "layer_types",
            f"[..., {kinds[-1]!r}]",
            "the last layer must be full_attention, as transformers makes it",
        )
    window = config.get("sliding_window", 512)
    if "sliding_attention" in kinds and not window:
        raise refuse(where, "sliding_window", window, "its sliding layers need a window")
    vocab = config["vocab_size"]
    per_layer_dim = config.get("hidden_size_per_layer_input", 256) or 0
    per_layer_vocab = config.get("vocab_size_per_layer_input", 262144)
    if per_layer_dim and per_layer_vocab != vocab:
        raise refuse(where, "vocab_size_per_layer_input", per_layer_vocab, f"titanlite takes vocab_size={vocab}")
    k_eq_v = bool(config.get("attention_k_eq_v", False))
    global_head_dim, n_global_kv_heads = _full_heads(config, where, kinds, n_kv_heads, k_eq_v)
    softcap = config.get("final_logit_softcapping")
    bias = bool(config.get("attention_bias"))
    fields = dict(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        ffn_dim=config.get("intermediate_size", 9216),
        vocab_size=vocab,
        max_seq_len=config.get("max_position_embeddings", 131072),
        norm_eps=config.get("rms_norm_eps", 1e-6),
        tie_embeddings=config.get("tie_word_embeddings", True),
        qkv_bias=bias,
        out_bias=bias,
        sliding_window=window if "sliding_attention" in kinds else 0,
        layer_types=kinds,
        global_head_dim=global_head_dim,
        n_global_kv_heads=n_global_kv_heads,
        k_eq_v=k_eq_v,
        per_layer_dim=per_layer_dim,
        kv_shared_layers=config.get("num_kv_shared_layers", 0),
        double_wide_mlp=bool(config.get("use_double_wide_mlp", False)),
        final_softcap=float(softcap) if softcap else 0.0,
        moe=_moe(config, where),
        **_rope(config, where),
    )
    shared = fields["kv_shared_layers"]
    if not 0 <= shared < n_layers or (shared and set(kinds[: n_layers - shared]) != set(kinds)):
        why = "every layer kind that reuses keys and values needs an earlier layer of its kind that computes them"
        raise refuse(where, "num_kv_shared_layers", shared, why)
    fraction = fields["rotary_fraction"]
    if not 0 < fraction <= 1 or int(fraction * global_head_dim // 2) < 1:
        why = f"it must turn at least one pair of global_head_dim={global_head_dim}, and at most all"
        raise refuse(where, "rope_parameters full_attention partial_rotary_factor", fraction, why)
    return Gemma4Args(**fields)


def write(args: Gemma4Args) -> dict:
    """The gemma4_text config.json fields of this model (the full layers' heads as global_head_dim and
    num_global_key_value_heads, the published form, which transformers 5 reads too)."""
    if args.qkv_bias != args.out_bias:
        raise refuse(
            "a gemma4 config.json",
            "qkv_bias/out_bias",
            (args.qkv_bias, args.out_bias),
            "Gemma 4 has one attention_bias",
        )
    m = args.moe
    if m is not None:  # softmax routing, the top k renormalised, experts on every layer, no shared expert or bias
        more = () if m.norm_topk_prob else (f"MoEArgs.norm_topk_prob={m.norm_topk_prob}",)
        check_expressible(m, "gemma4", dense_layers=False, more=more)
    full = {"rope_type": "proportional", "partial_rotary_factor": args.rotary_fraction, "rope_theta": args.rope_theta}
    if args.rope_factor != 1.0:
        full["factor"] = args.rope_factor
    return {
        **decoder_fields(args, "Gemma4ForCausalLM", MODEL_TYPE, ("hidden_activation", ACTIVATION)),
        "global_head_dim": args.global_head_dim,
        "num_global_key_value_heads": args.n_global_kv_heads if args.k_eq_v else None,
        "attention_k_eq_v": args.k_eq_v,
        # Without sliding layers the window is unused; transformers still builds its mask from a number.
        "sliding_window": args.sliding_window or args.max_seq_len,
        "layer_types": list(args.kinds()),
        "rope_parameters": {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": args.rope_local_theta},
        },
        "attention_bias": args.qkv_bias,
        "attention_dropout": 0.0,
        "final_logit_softcapping": args.final_softcap or None,
        "use_bidirectional_attention": None,
        "hidden_size_per_layer_input": args.per_layer_dim,
        "vocab_size_per_layer_input": args.vocab_size,
        "num_kv_shared_layers": args.kv_shared_layers,
        "use_double_wide_mlp": args.double_wide_mlp,
        "enable_moe_block": m is not None,
        "num_experts": m.n_experts if m else None,
        "top_k_experts": m.top_k if m else None,
        "moe_intermediate_size": m.expert_dim if m else None,
    }
