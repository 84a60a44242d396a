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
from titanlite.base.hf_decoder import FAMILY_OF_TYPE, decoder_args, decoder_config, refuse
from titanlite.base.model_args import GPT2Args, LlamaArgs, family_of

CONFIG_FILE = "config.json"
# Our model family (model.name) of each supported config.json model_type.
FAMILIES = {"gpt2": "gpt2", **FAMILY_OF_TYPE}


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
        return {**decoder_config(args), **common, **dtypes}
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


def _check_no_unsupported(config: dict, where: str) -> None:
    """Refuse the fields titanlite does not implement in any family (MoE, quantization)."""
    for key in _MOE_FIELDS:
        if config.get(key):
            raise refuse(where, key, config[key], "titanlite has dense MLPs, no mixture of experts")
    if config.get("quantization_config"):
        raise refuse(where, "quantization_config", "{...}", "titanlite reads unquantized weights only")


def _gpt2_args(config: dict, where: str) -> GPT2Args:
    dim, n_heads = config["n_embd"], config["n_head"]
    activation = config.get("activation_function", "gelu_new")
    if activation not in _GPT2_ACTIVATIONS:
        raise refuse(
            where, "activation_function", activation, f"the MLP's GELU is one of {', '.join(_GPT2_ACTIVATIONS)}"
        )
    if config.get("scale_attn_by_inverse_layer_idx"):
        raise refuse(where, "scale_attn_by_inverse_layer_idx", True, "no per-layer attention scaling")
    if config.get("scale_attn_weights", True) is not True:
        raise refuse(where, "scale_attn_weights", config["scale_attn_weights"], "attention scales by 1/sqrt(head_dim)")
    if config.get("add_cross_attention"):
        raise refuse(where, "add_cross_attention", True, "titanlite's GPT-2 is a decoder without cross-attention")
    if dim % n_heads:
        raise refuse(where, "n_head", n_heads, f"it must divide n_embd={dim}")
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


def args_from_hf_config(config: dict, where: str = "config.json") -> GPT2Args | LlamaArgs:
    """Our model arguments from a transformers config.json, any shape. Every field that changes the math is
    honoured or refused with one line naming it. The vocabulary is taken as is (not padded), so the imported
    model's logits match the HF model's column for column."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        known = ", ".join(repr(t) for t in FAMILIES)
        raise ConfigError(f"{where} model_type={model_type!r} is not supported; titanlite reads {known}")
    _check_no_unsupported(config, where)
    try:
        return _gpt2_args(config, where) if model_type == "gpt2" else decoder_args(config, where)
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
        if args.sliding_window:
            raise ConfigError(
                f"training.seq_len={seq_len} is longer than the sliding_window={args.sliding_window} of {folder}: "
                "titanlite attends to the whole context, which equals the window's attention only within it; use "
                f"training.seq_len <= {args.sliding_window}"
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
    family = family_of(args)
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
