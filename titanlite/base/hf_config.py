"""A Hugging Face model folder's config.json: reading it, the JSON type of every field a family reads (checked before
any family reads one), the fields that change only how training computes (dropout, router noise), and the one-line
refusal of a field titanlite does not build. Torch-free. Each family's own fields are its folder's
(titanlite/models/<family>/); the dispatch by model_type is titanlite/models/hf_config.py's."""

from __future__ import annotations

import json
import math
from pathlib import Path

from titanlite.base.errors import ConfigError

CONFIG_FILE = "config.json"
# Fields of other kinds of model that a relabelled config.json may carry: each changes the math and is not built.
_MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


def refuse(where: str, key: str, value, why: str) -> ConfigError:
    return ConfigError(f"{where} {key}={value!r} is not supported: {why}")


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from e


def read_config(folder: str | Path) -> dict:
    """A Hugging Face model folder's config.json, as a dict."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"Hugging Face model folder {folder} does not exist")
    if not (folder / CONFIG_FILE).is_file():
        raise ConfigError(f"{folder / CONFIG_FILE} does not exist")
    return read_json(folder / CONFIG_FILE)


def stored_tensor_names(folder: str | Path) -> set[str] | None:
    """The tensor names a folder's weights hold, from model.safetensors.index.json's weight_map or model.safetensors'
    header (its first bytes: no tensor is read); None where it holds neither (a folder of config files only)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        return set(weight_map) if isinstance(weight_map, dict) else None
    weights = folder / "model.safetensors"
    if not weights.is_file():
        return None
    try:
        with weights.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
    except (OSError, ValueError):
        return None  # unreadable: the weights' own reader says why, in its words
    return set(header) - {"__metadata__"} if isinstance(header, dict) else None


def check_no_unsupported(config: dict, where: str, experts: bool = False) -> None:
    """Refuse the fields titanlite does not implement in any family (quantization), and the mixture-of-experts
    fields in a family whose MLPs are dense (experts=False)."""
    for key in () if experts else _MOE_FIELDS:
        if config.get(key):
            raise refuse(where, key, config[key], f"a {config.get('model_type')} model has dense MLPs, no experts")
    quantization_of(config, where)


# The quantized formats a folder may come in (quantization_config.quant_method), dequantized as each tensor is read
# (titanlite/components/hf_quantized.py): "fp8", e4m3 values with a float32 scale_inv per weight_block_size block
# (DeepSeek-V3, Kimi K2, GLM-4.5-FP8, MiniMax-M2); "mxfp4", e2m1 values with a power-of-two scale per 32 (gpt-oss's
# experts).
QUANT_METHODS = ("fp8", "mxfp4")


FP8_FORMATS = ("e4m3", "float8_e4m3fn")


def quantization_of(config: dict, where: str) -> dict | None:
    """A folder's quantization (None: its weights are plain floats): {"method": "fp8", "block": (rows, cols)} or
    {"method": "mxfp4"}; a method titanlite does not read, or an fp8 one without its block size, refused in one line
    naming the supported ones."""
    quantization = config.get("quantization_config")
    if not quantization:
        return None
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if method not in QUANT_METHODS:
        raise ConfigError(
            f"{where} quantization_config (quant_method {method!r}) is not supported: titanlite reads fp8 "
            "(block-scaled e4m3) and mxfp4 folders, and unquantized ones (float32, bfloat16 or float16); use a copy "
            "in one of those"
        )
    if method == "mxfp4":
        return {"method": method}
    block = quantization.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise refuse(
            where, "quantization_config.weight_block_size", block, "fp8 weights are read by their [rows, cols] blocks"
        )
    fmt = quantization.get("fmt", "e4m3")
    if fmt not in FP8_FORMATS:  # DeepSeek's and GLM's folders write "e4m3", MiniMax-M2's torch's name for it
        raise refuse(where, "quantization_config.fmt", fmt, "titanlite reads fp8 as e4m3 ('e4m3' or 'float8_e4m3fn')")
    return {"method": method, "block": tuple(block)}


# ---- the JSON type of each field -------------------------------------------------------------------------------

# What a field's value must be, in words (the refusal says it).
COUNT = "a whole number of at least 1"
WHOLE = "a whole number of 0 or more"
NUMBER = "a finite number"
NONNEGATIVE = "a finite number of 0 or more"
POSITIVE = "a finite number above 0"
FLAG = "true or false"
TEXT = "a string"
TEXTS = "a list of strings"
WHOLES = "a list of whole numbers of 0 or more"
OBJECT = "a JSON object"
# Every config.json field a family reads: (what it must be, whether null stands for "absent", as the readers take
# it). Names mean the same in every family's config.json, so one table serves them all; a field no family reads is
# not checked.
FIELDS: dict[str, tuple[str, bool]] = {
    "model_type": (TEXT, False),
    "hidden_size": (COUNT, False),
    "intermediate_size": (COUNT, False),
    "num_hidden_layers": (COUNT, False),
    "num_attention_heads": (COUNT, False),
    "num_key_value_heads": (COUNT, True),
    "head_dim": (COUNT, True),
    "vocab_size": (COUNT, False),
    "max_position_embeddings": (COUNT, False),
    "original_max_position_embeddings": (COUNT, True),
    "rms_norm_eps": (NONNEGATIVE, False),
    "tie_word_embeddings": (FLAG, False),
    "hidden_act": (TEXT, False),
    "hidden_activation": (TEXT, True),
    "attention_bias": (FLAG, False),
    "mlp_bias": (FLAG, False),
    "rope_theta": (POSITIVE, False),
    "rope_scaling": (OBJECT, True),
    "rope_parameters": (OBJECT, True),
    "rope_local_base_freq": (POSITIVE, False),
    "rope_interleave": (FLAG, False),
    "sliding_window": (WHOLE, True),
    "use_sliding_window": (FLAG, False),
    "max_window_layers": (WHOLE, False),
    "layer_types": (TEXTS, True),
    "sliding_window_pattern": (COUNT, False),
    "query_pre_attn_scalar": (POSITIVE, False),
    "final_logit_softcapping": (NUMBER, True),
    "attn_logit_softcapping": (NUMBER, True),
    "use_bidirectional_attention": (FLAG, True),
    "no_rope_layers": (WHOLES, True),
    "no_rope_layer_interval": (COUNT, False),
    "clip_qkv": (NUMBER, True),
    "quantization_config": (OBJECT, True),
    # GPT-2's
    "n_embd": (COUNT, False),
    "n_layer": (COUNT, False),
    "n_head": (COUNT, False),
    "n_inner": (COUNT, True),
    "n_positions": (COUNT, False),
    "layer_norm_epsilon": (NONNEGATIVE, False),
    "activation_function": (TEXT, False),
    "scale_attn_weights": (FLAG, False),
    "scale_attn_by_inverse_layer_idx": (FLAG, False),
    "add_cross_attention": (FLAG, False),
    # mixture of experts
    "num_experts": (WHOLE, True),
    "num_local_experts": (WHOLE, True),
    "n_routed_experts": (WHOLE, True),
    "num_experts_per_tok": (COUNT, False),
    "experts_per_token": (COUNT, False),
    "moe_intermediate_size": (COUNT, False),
    "shared_expert_intermediate_size": (WHOLE, True),
    "n_shared_experts": (WHOLE, True),
    "norm_topk_prob": (FLAG, False),
    "router_aux_loss_coef": (NONNEGATIVE, False),
    "decoder_sparse_step": (COUNT, False),
    "mlp_only_layers": (WHOLES, True),
    "routed_scaling_factor": (POSITIVE, False),
    "n_group": (COUNT, True),
    "topk_group": (COUNT, True),
    "first_k_dense_replace": (WHOLE, True),
    "moe_layer_freq": (COUNT, False),
    "scoring_func": (TEXT, False),
    "topk_method": (TEXT, False),
    "swiglu_alpha": (NUMBER, False),
    "swiglu_limit": (POSITIVE, False),
    # latent attention, multi-token prediction
    "q_lora_rank": (WHOLE, True),
    "kv_lora_rank": (COUNT, False),
    "qk_nope_head_dim": (COUNT, False),
    "qk_rope_head_dim": (COUNT, False),
    "v_head_dim": (COUNT, False),
    "num_nextn_predict_layers": (WHOLE, True),
    "num_mtp_layers": (WHOLE, True),
    "mtp_num_hidden_layers": (WHOLE, True),
    # Kimi Linear's: transformers' names, then those of the published checkpoint that mean the same
    "mlp_layer_types": (TEXTS, True),
    "linear_attn_config": (OBJECT, True),
    "linear_num_heads": (COUNT, False),
    "linear_head_dim": (COUNT, False),
    "linear_conv_kernel_dim": (COUNT, False),
    "mla_use_nope": (FLAG, True),
    "moe_router_activation_func": (TEXT, True),
    "num_experts_per_token": (COUNT, False),
    "num_shared_experts": (WHOLE, True),
    "moe_renormalize": (FLAG, False),
    "num_expert_group": (COUNT, True),
    "model_max_length": (COUNT, False),
    # the hybrid decoders' (Qwen3.5, Qwen3-Next, OLMo Hybrid): the linear layers, the full layers' partial rotary
    "linear_num_key_heads": (COUNT, False),
    "linear_num_value_heads": (COUNT, False),
    "linear_key_head_dim": (COUNT, False),
    "linear_value_head_dim": (COUNT, False),
    "linear_allow_neg_eigval": (FLAG, False),
    "full_attention_interval": (COUNT, False),
    "partial_rotary_factor": (POSITIVE, False),
    "text_config": (OBJECT, False),
    # Gemma 4's: the full layers' heads, keys equal to values, per-layer embeddings, shared keys and values, experts
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
    # MiniMax-M2's: which layers are softmax attention (all, 1), its rotated channels, multi-token prediction
    "attn_type_list": (WHOLES, True),
    "rotary_dim": (COUNT, True),
    "use_mtp": (FLAG, True),
    "num_mtp_modules": (WHOLE, True),
}
# The fields of a rope_scaling / rope_parameters object (and of each per-layer-type object Gemma 3's holds).
ROPE_FIELDS: dict[str, tuple[str, bool]] = {
    "rope_type": (TEXT, True),
    "type": (TEXT, True),
    "rope_theta": (POSITIVE, False),
    "factor": (POSITIVE, False),
    "original_max_position_embeddings": (COUNT, True),
    "low_freq_factor": (POSITIVE, True),
    "high_freq_factor": (POSITIVE, True),
    "beta_fast": (NUMBER, True),
    "beta_slow": (NUMBER, True),
    "mscale": (NONNEGATIVE, True),
    "mscale_all_dim": (NONNEGATIVE, True),
    "attention_factor": (NONNEGATIVE, True),
    "truncate": (FLAG, True),
}
_LAYER_TYPES = ("full_attention", "sliding_attention")


def check_types(config: dict, where: str, nullable: tuple[str, ...] = ()) -> None:
    """Refuse, in one line naming it, a field whose JSON value is not what every reader of it takes ("4" or [96]
    where a count goes, true where a number goes, null where a value is needed): a family would otherwise pass it
    on to the model's constructor, a traceback, or read it as something else (bool("false") is True). `nullable`:
    the fields whose null the family's reader takes itself (OLMo Hybrid's rope_theta: no rotation)."""
    for key, value in config.items():
        if key in FIELDS and not (value is None and key in nullable):
            _check_value(key, value, *FIELDS[key], where)
    for key in ("rope_scaling", "rope_parameters"):
        rope = config.get(key) or {}
        if rope and set(rope) <= set(_LAYER_TYPES):  # Gemma 3's: one object per layer type
            for kind, inner in rope.items():
                _check_value(f"{key}.{kind}", inner, OBJECT, True, where)
                _check_rope(inner or {}, f"{key}.{kind}", where)
        else:
            _check_rope(rope, key, where, nullable)


def _check_rope(rope: dict, name: str, where: str, nullable: tuple[str, ...] = ()) -> None:
    for field, value in rope.items():
        if value is None and field in nullable:
            continue
        if field in ROPE_FIELDS:
            _check_value(f"{name}.{field}", value, *ROPE_FIELDS[field], where)


def _check_value(key: str, value, kind: str, nullable: bool, where: str) -> None:
    if value is None and nullable:
        return
    if not _is(value, kind):
        raise ConfigError(f"{where} {key}={_json(value)} is not {kind}; {_fix(value, kind)}")


def _is(value, kind: str) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    whole = isinstance(value, int) and not isinstance(value, bool)
    if kind == COUNT:
        return whole and value >= 1
    if kind == WHOLE:
        return whole and value >= 0
    if kind == NUMBER:
        return number
    if kind == NONNEGATIVE:
        return number and value >= 0
    if kind == POSITIVE:
        return number and value > 0
    if kind == FLAG:
        return isinstance(value, bool)
    if kind == TEXT:
        return isinstance(value, str)
    if kind == TEXTS:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if kind == WHOLES:
        return isinstance(value, list) and all(_is(v, WHOLE) for v in value)
    return isinstance(value, dict)


def _json(value) -> str:
    """The value as config.json writes it ("4", [96], true, null), shortened."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _fix(value, kind: str) -> str:
    """What to write instead: the value itself where it is only dressed wrong (a number or flag in quotes, a number
    in a list of one, a count written 4.0)."""
    unquoted = None
    if isinstance(value, str):
        try:
            unquoted = json.loads(value)
        except ValueError:
            pass
    if unquoted is not None and _is(unquoted, kind):
        return f"write {value} without the quotes"
    if isinstance(value, list) and len(value) == 1 and _is(value[0], kind):
        return f"write {_json(value[0])}, not a list"
    if isinstance(value, float) and value.is_integer() and _is(int(value), kind):
        return f"write {int(value)}"
    return "correct it in config.json"


# ---- fields that change how training computes -------------------------------------------------------------------

# Randomness added only in training, which titanlite does not add: a run on such a config.json would train
# another model than the one config.json describes. Inference ignores them (generate and eval read such a folder).
TRAINING_NOISE = ("router_jitter_noise", "layerdrop")
# Dropout fields of heads titanlite never builds (GPT-2's multiple-choice summary head, classification heads).
OTHER_HEADS = ("summary_first_dropout", "classifier_dropout")


def check_training_fields(config: dict, where: str) -> None:
    """Refuse a config.json that asks for dropout or router noise in training (attention_dropout, hidden_dropout,
    attn_pdrop, resid_pdrop, embd_pdrop, router_jitter_noise, ... non-zero), naming every such field in one line."""
    asked = []
    for key, value in config.items():
        noise = key in TRAINING_NOISE or (("dropout" in key or key.endswith("_pdrop")) and key not in OTHER_HEADS)
        if not noise or value is None:
            continue
        _check_value(key, value, NONNEGATIVE, True, where)
        if value:
            asked.append(f"{key}={_json(value)}")
    if asked:
        them = "it" if len(asked) == 1 else "them"
        raise ConfigError(
            f"{where} {', '.join(asked)}: titanlite trains without dropout or router noise, so this would train "
            f"another model than config.json describes; set {them} to 0.0 in config.json"
        )
