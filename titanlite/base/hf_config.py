"""A Hugging Face model folder's config.json: reading it, the JSON type of every field a family reads (checked before
any family reads one), the fields that change only how training computes (dropout, router noise), and the one-line
refusal of a field titanlite does not build. Torch-free. Each family's own fields are its folder's
(titanlite/models/<family>/); the dispatch by model_type is titanlite/models/hf_config.py's."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

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
# (DeepSeek-V3, Kimi K2, GLM-4.5-FP8, MiniMax-M2), or a power-of-two one (scale_fmt "ue8m0": DeepSeek-V4, whose
# experts may be fp4, expert_dtype "fp4"); "mxfp4", e2m1 values with a power-of-two scale per 32 (gpt-oss's experts).
QUANT_METHODS = ("fp8", "mxfp4")


FP8_FORMATS = ("e4m3", "float8_e4m3fn")
# An fp8 folder's scales: "float" (float32 scale_inv, DeepSeek-V3's) or "ue8m0" (E8M0 powers of two, DeepSeek-V4's).
SCALE_FORMATS = ("float", "ue8m0")
# What an fp8 folder's experts are stored as (DeepSeek-V4's expert_dtype): e4m3 like its other weights, or e2m1 packed
# two a byte with a power-of-two scale per 32 values.
EXPERT_DTYPES = ("fp8", "fp4")


def quantization_of(config: dict, where: str) -> dict | None:
    """A folder's quantization (None: its weights are plain floats): {"method": "fp8", "block": (rows, cols)}, with
    "scale_fmt" and "expert_dtype" where the folder gives them (expert_dtype in quantization_config or, as the published
    DeepSeek-V4 folders write it, at config.json's top level), or {"method": "mxfp4"}; a method titanlite does not
    read, an fp8 one without its block size, or another scale_fmt or expert_dtype, refused in one line naming it."""
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
    return {"method": method, "block": tuple(block), **_fp8_options(config, quantization, where)}


def _fp8_options(config: dict, quantization: dict, where: str) -> dict:
    """An fp8 folder's scale_fmt and expert_dtype, those it gives (null taken as absent), each refused unless read."""
    options = {}
    scale_fmt = quantization.get("scale_fmt")
    if scale_fmt is not None:
        if scale_fmt not in SCALE_FORMATS:
            raise refuse(
                where, "quantization_config.scale_fmt", scale_fmt, "titanlite reads fp8 scales as float32 ('float') "
                "or as E8M0 powers of two ('ue8m0')",
            )  # fmt: skip
        options["scale_fmt"] = scale_fmt
    inner, outer = quantization.get("expert_dtype"), config.get("expert_dtype")
    if inner is not None and outer is not None and inner != outer:
        raise refuse(where, "expert_dtype", outer, f"it differs from quantization_config.expert_dtype={inner!r}")
    expert_dtype = inner if inner is not None else outer
    if expert_dtype is not None:
        if expert_dtype not in EXPERT_DTYPES:
            key = "quantization_config.expert_dtype" if inner is not None else "expert_dtype"
            raise refuse(
                where, key, expert_dtype, "titanlite reads an fp8 folder's experts as fp8 (e4m3) or fp4 (e2m1 packed "
                "two a byte, a power-of-two scale per 32)",
            )  # fmt: skip
        options["expert_dtype"] = expert_dtype
    return options


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
# The config.json fields every decoder family shares (the shared decoder's reader, titanlite/models/common/
# decoder_config.py, its rotations and windows; the front door's model_type; quantization): (what it must be, whether
# null stands for "absent", as the readers take it). A family declares the fields it reads beyond these in its own
# table (its spec's HFConfig.fields: its folder's hf_config.py, with the shared tables of the blocks it reads, as
# titanlite/models/common/moe/hf_config.py's); check_types checks both. A field no table of the family names is not
# checked (its reader does not take it).
FieldTypes = Mapping[str, tuple[str, bool]]
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
    "attention_bias": (FLAG, False),
    "mlp_bias": (FLAG, False),
    "rope_theta": (POSITIVE, False),
    "rope_scaling": (OBJECT, True),
    "rope_parameters": (OBJECT, True),
    "partial_rotary_factor": (POSITIVE, False),
    "sliding_window": (WHOLE, True),
    "use_sliding_window": (FLAG, False),
    "max_window_layers": (WHOLE, False),
    "layer_types": (TEXTS, True),
    "quantization_config": (OBJECT, True),
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


def check_types(
    config: dict, where: str, fields: FieldTypes = MappingProxyType({}), nullable: tuple[str, ...] = ()
) -> None:
    """Refuse, in one line naming it, a field whose JSON value is not what every reader of it takes ("4" or [96]
    where a count goes, true where a number goes, null where a value is needed): a family would otherwise pass it
    on to the model's constructor, a traceback, or read it as something else (bool("false") is True). The fields
    checked: the shared ones (FIELDS) and the family's own, `fields` (its spec's HFConfig.fields). `nullable`: the
    fields whose null the family's reader takes itself (OLMo Hybrid's rope_theta: no rotation)."""
    types = {**FIELDS, **fields}
    for key, value in config.items():
        if key in types and not (value is None and key in nullable):
            _check_value(key, value, *types[key], where)
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
