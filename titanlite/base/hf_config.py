"""A Hugging Face model folder's config.json, both ways: read into our model arguments (every field that
changes the math honoured, or refused with one line naming it) and written from them for an export.

Torch-free: the configuration (layer 1) reads a folder's config.json through it to resolve model.flavor = "hf".
Weights and tokenizer files are titanlite/components/hf_weights.py's and hf_tokenizer.py's.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from titanlite.base.errors import ConfigError
from titanlite.base.model_args import FAMILY_OF_ARGS, GPT2Args, Llama3RopeScaling, LlamaArgs

CONFIG_FILE = "config.json"
# Our model family (model.name) of each supported config.json model_type.
FAMILIES = {"gpt2": "gpt2", "llama": "llama3"}


def is_llama(args) -> bool:
    if isinstance(args, LlamaArgs):
        return True
    if isinstance(args, GPT2Args):
        return False
    raise ConfigError(f"Hugging Face export supports GPT2Args and LlamaArgs, not {type(args).__name__}")


def hf_config(args, dtype: str = "float32", token_ids: dict | None = None) -> dict:
    """The config.json content that makes transformers build exactly this model.

    vocab_size is the model's (for a named flavor, the tokenizer's padded to a multiple of 64, e.g. 50304
    for GPT-2's 50257 tokens: ids past the tokenizer's are never produced by it). dtype is the dtype the
    weights are saved in; token_ids the tokenizer's bos/eos ids (none rather than GPT2Config's/LlamaConfig's
    defaults, which may not even be in our vocabulary)."""
    ids = {"bos_token_id": None, "eos_token_id": None, **(token_ids or {})}
    common = {"vocab_size": args.vocab_size, "tie_word_embeddings": args.tie_embeddings, **ids, "pad_token_id": None}
    # transformers >= 4.56 reads "dtype"; older versions read "torch_dtype".
    dtypes = {"dtype": dtype, "torch_dtype": dtype}
    if is_llama(args):
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": args.dim,
            "intermediate_size": args.ffn_dim,
            "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.n_kv_heads,
            "head_dim": args.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": args.norm_eps,
            "max_position_embeddings": args.max_seq_len,
            # transformers 5 reads rope_parameters; 4.x reads the top-level rope_theta and rope_scaling.
            "rope_theta": args.rope_theta,
            "rope_parameters": {"rope_theta": args.rope_theta, **_rope_scaling_to_hf(args.rope_scaling)},
            "rope_scaling": _rope_scaling_to_hf(args.rope_scaling) if args.rope_scaling else None,
            "attention_bias": False,
            "mlp_bias": False,
            "attention_dropout": 0.0,
            "pretraining_tp": 1,
            **common,
            **dtypes,
        }
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "n_embd": args.dim,
        "n_layer": args.n_layers,
        "n_head": args.n_heads,
        "n_inner": args.ffn_dim,
        "n_positions": args.max_seq_len,
        "layer_norm_epsilon": args.norm_eps,
        "activation_function": _GPT2_ACTIVATION_TO_HF[args.activation],
        "attn_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "resid_pdrop": 0.0,
        "summary_first_dropout": 0.0,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        **common,
        **dtypes,
    }


def _rope_scaling_to_hf(scaling: Llama3RopeScaling | None) -> dict:
    if scaling is None:
        return {"rope_type": "default"}
    return {"rope_type": "llama3", **dataclasses.asdict(scaling)}


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


# ---- config.json -> our model arguments ------------------------------------------------------------------

# HF activation names that are our GPT-2 MLP's GELUs ("gelu_fast" is the tanh formula written differently).
_GPT2_ACTIVATIONS = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu": "gelu",
}
_GPT2_ACTIVATION_TO_HF = {"gelu_tanh": "gelu_new", "gelu": "gelu"}
# Fields of other families that a relabelled config.json may carry: each changes the math and is not built.
_MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


def _refuse(where: str, key: str, value, why: str) -> ConfigError:
    return ConfigError(f"{where} {key}={value!r} is not supported: {why}")


def _check_no_unsupported(config: dict, where: str) -> None:
    """Refuse the fields titanlite does not implement (sliding windows, NoPE layers, MoE, quantization)."""
    if config.get("sliding_window") not in (None, 0) and config.get("use_sliding_window", True):
        raise _refuse(where, "sliding_window", config["sliding_window"], "attention is over the whole causal context")
    layer_types = config.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise _refuse(where, "layer_types", sorted(set(layer_types)), "every layer has full causal attention")
    if any(not use for use in config.get("no_rope_layers") or []):
        raise _refuse(where, "no_rope_layers", "[...0...]", "every layer applies RoPE (no NoPE layers)")
    for key in _MOE_FIELDS:
        if config.get(key):
            raise _refuse(where, key, config[key], "titanlite has dense MLPs, no mixture of experts")
    if config.get("quantization_config"):
        raise _refuse(where, "quantization_config", "{...}", "titanlite reads unquantized weights only")


def _gpt2_args(config: dict, where: str) -> GPT2Args:
    dim, n_heads = config["n_embd"], config["n_head"]
    activation = config.get("activation_function", "gelu_new")
    if activation not in _GPT2_ACTIVATIONS:
        raise _refuse(
            where, "activation_function", activation, f"the MLP's GELU is one of {', '.join(_GPT2_ACTIVATIONS)}"
        )
    if config.get("scale_attn_by_inverse_layer_idx"):
        raise _refuse(where, "scale_attn_by_inverse_layer_idx", True, "no per-layer attention scaling")
    if config.get("scale_attn_weights", True) is not True:
        raise _refuse(where, "scale_attn_weights", config["scale_attn_weights"], "attention scales by 1/sqrt(head_dim)")
    if config.get("add_cross_attention"):
        raise _refuse(where, "add_cross_attention", True, "titanlite's GPT-2 is a decoder without cross-attention")
    if dim % n_heads:
        raise _refuse(where, "n_head", n_heads, f"it must divide n_embd={dim}")
    return GPT2Args(
        dim=dim,
        n_layers=config["n_layer"],
        n_heads=n_heads,
        vocab_size=config["vocab_size"],
        max_seq_len=config.get("n_positions", 1024),
        norm_eps=config.get("layer_norm_epsilon", 1e-5),
        tie_embeddings=config.get("tie_word_embeddings", True),
        ffn_dim=config.get("n_inner") or 4 * dim,
        activation=_GPT2_ACTIVATIONS[activation],
    )


def _llama_rope(config: dict, where: str) -> tuple[float, Llama3RopeScaling | None]:
    """rope_theta and the llama3 frequency scaling, from transformers 5's rope_parameters or 4.x's top-level
    rope_theta and rope_scaling; other RoPE types (linear, dynamic, yarn, longrope) are refused."""
    rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return theta, None
    key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    if rope_type != "llama3":
        raise ConfigError(
            f"{where} {key} rope_type={rope_type!r} is not supported: titanlite implements "
            "unscaled RoPE and Llama 3.1's 'llama3' scaling"
        )
    fields = [f.name for f in dataclasses.fields(Llama3RopeScaling)]
    absent = [f for f in fields if rope.get(f) is None]
    if absent:
        raise ConfigError(f"{where} {key} of rope_type 'llama3' lacks {absent[0]!r}")
    scaling = Llama3RopeScaling(**{f: rope[f] for f in fields})
    if scaling.high_freq_factor <= scaling.low_freq_factor:
        raise ConfigError(
            f"{where} {key} needs high_freq_factor > low_freq_factor, not {scaling.high_freq_factor} "
            f"and {scaling.low_freq_factor}"
        )
    return theta, scaling


def _llama_args(config: dict, where: str) -> LlamaArgs:
    dim, n_heads = config["hidden_size"], config["num_attention_heads"]
    n_kv_heads = config.get("num_key_value_heads") or n_heads
    if config.get("hidden_act", "silu") != "silu":
        raise _refuse(where, "hidden_act", config["hidden_act"], "the MLP is SwiGLU (silu)")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise _refuse(where, key, True, "titanlite's Llama has no biases")
    if n_heads % n_kv_heads:
        raise _refuse(where, "num_key_value_heads", n_kv_heads, f"it must divide num_attention_heads={n_heads}")
    head_dim = config.get("head_dim") or dim // n_heads
    if head_dim % 2:
        raise _refuse(where, "head_dim", head_dim, "RoPE rotates pairs, so it must be even")
    rope_theta, rope_scaling = _llama_rope(config, where)
    return LlamaArgs(
        dim=dim,
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        ffn_dim=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        max_seq_len=config.get("max_position_embeddings", 2048),
        rope_theta=rope_theta,
        norm_eps=config.get("rms_norm_eps", 1e-6),  # LlamaConfig's defaults where a key is absent
        tie_embeddings=config.get("tie_word_embeddings", False),
        head_dim=head_dim,
        rope_scaling=rope_scaling,
    )


def args_from_hf_config(config: dict, where: str = "config.json") -> GPT2Args | LlamaArgs:
    """Our model arguments from a transformers config.json, any shape. Every field that changes the math is
    honoured or refused with one line naming it. The vocabulary is taken as is (not padded), so the imported
    model's logits match the HF model's column for column."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise ConfigError(f"{where} model_type={model_type!r} is not supported; titanlite reads 'gpt2' and 'llama'")
    _check_no_unsupported(config, where)
    try:
        return _gpt2_args(config, where) if model_type == "gpt2" else _llama_args(config, where)
    except KeyError as e:
        raise ConfigError(f"{where} for model_type={model_type!r} lacks {e.args[0]!r}") from e


def folder_model_args(folder: str | Path) -> GPT2Args | LlamaArgs:
    """The model a Hugging Face folder holds, from its config.json (errors name the file)."""
    return args_from_hf_config(read_config(folder), f"{Path(folder) / CONFIG_FILE}:")


def folder_args(folder: str | Path, seq_len: int) -> GPT2Args | LlamaArgs:
    """The model of model.flavor = "hf": the shape and math of the folder's config.json, for this run's
    sequence length (GPT-2's learned positions cannot grow; Llama's RoPE tables are computed to cover it)."""
    args = folder_model_args(folder)
    if seq_len > args.max_seq_len:
        if isinstance(args, GPT2Args):
            raise ConfigError(
                f"training.seq_len={seq_len} is longer than the {args.max_seq_len} learned positions of "
                f"{folder} (n_positions); use training.seq_len <= {args.max_seq_len}"
            )
        args = dataclasses.replace(args, max_seq_len=seq_len)
    return args


def resolve_model_folder(model, explicit: set[str]) -> None:
    """With model.flavor = "hf", take model.name (and model.tokenizer, when the folder has a tokenizer.json)
    from model.hf_assets_path, in place; a key set explicitly to something else is an error, not ignored."""
    folder = model.hf_assets_path
    if not folder:
        raise ConfigError(
            "model.flavor='hf' takes the model from model.hf_assets_path; set it to a Hugging Face "
            "model folder (config.json, safetensors, tokenizer.json)"
        )
    args = folder_model_args(folder)
    family = FAMILY_OF_ARGS[type(args)]
    has_tokenizer = (Path(folder) / "tokenizer.json").is_file()
    wanted = {"model.name": family}
    if has_tokenizer:
        wanted["model.tokenizer"] = "hf"
    elif family == "gpt2" and args.vocab_size in (50257, 50304):
        wanted["model.tokenizer"] = "gpt2"  # GPT-2's own vocabulary (folders with vocab.json/merges.txt only)
    elif "model.tokenizer" not in explicit:
        raise ConfigError(
            f"{folder} has no tokenizer.json; set model.tokenizer to the tokenizer its model was trained "
            "with ('gpt2', 'byte', or 'hf' with model.hf_assets_path naming a folder that has one)"
        )
    if model.n_layers:
        wanted["model.n_layers"] = args.n_layers
    for key, value in wanted.items():
        ours = getattr(model, key.split(".")[1])
        if key in explicit and ours != value:
            raise ConfigError(
                f"{key}={ours!r} contradicts {folder} ({key} {value!r}); leave it out or set it to "
                f"{value!r}, or use a named model.flavor"
            )
        setattr(model, key.split(".")[1], value)
