"""A Hugging Face folder's config.json into our model arguments and back, for any registered family: the
family is the one whose spec reads the model_type. Torch-free: the configuration resolves model.flavor = "hf"
through it. Weights and tokenizer files are titanlite/components/hf_weights.py's and hf_tokenizer.py's."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from titanlite.base.errors import ConfigError
from titanlite.base.hf_config import (
    CONFIG_FILE,
    check_no_unsupported,
    check_types,
    read_config,
    stored_tensor_names,
)
from titanlite.models.registry import spec_of, spec_of_model_type


def hf_config(args, dtype: str = "float32", token_ids: dict | None = None) -> dict:
    """The config.json content that makes transformers build exactly this model.

    vocab_size is the model's (for a named flavor, the tokenizer's padded to a multiple of 64, e.g. 50304
    for GPT-2's 50257 tokens: ids past the tokenizer's are never produced by it). dtype is the dtype the
    weights are saved in; token_ids the tokenizer's bos/eos ids (none rather than transformers' config
    defaults, which may not even be in our vocabulary)."""
    spec = spec_of(args)
    if spec.hf is None:
        raise ConfigError(f"model.name={spec.name!r} has no Hugging Face config.json to export as")
    ids = {"bos_token_id": None, "eos_token_id": None, **(token_ids or {})}
    common = {"vocab_size": args.vocab_size, "tie_word_embeddings": args.tie_embeddings, **ids, "pad_token_id": None}
    # transformers >= 4.56 reads "dtype"; older versions read "torch_dtype".
    return {**spec.hf.write(args), **common, "dtype": dtype, "torch_dtype": dtype}


def args_from_hf_config(config: dict, where: str = "config.json"):
    """Our model arguments from a transformers config.json, any registered family. Every field that changes the
    math is honoured or refused with one line naming it, and so is a field of the wrong JSON type (check_types,
    before the family reads any). The vocabulary is taken as is (not padded), so the imported model's logits match
    the HF model's column for column. Dropout and other training-only fields: check_training_fields."""
    model_type = config.get("model_type")
    spec = spec_of_model_type(model_type, where)
    assert spec.hf is not None  # found by its Hugging Face model_type
    check_types(config, where, spec.hf.fields, spec.hf.nullable)
    check_no_unsupported(config, where, experts=spec.hf.experts)
    try:
        return spec.hf.read(config, where)
    except KeyError as e:
        raise ConfigError(f"{where} for model_type={model_type!r} lacks {e.args[0]!r}") from e
    except ConfigError:
        raise
    except ValueError as e:  # an arguments class's own check that no reader put in config.json's words
        raise ConfigError(f"{where} is not supported: {e}") from e


def folder_model_args(folder: str | Path):
    """The model a Hugging Face folder holds, from its config.json (errors name the file), with the multi-token
    prediction layers its weights hold (held_mtp_layers)."""
    declared = args_from_hf_config(read_config(folder), f"{Path(folder) / CONFIG_FILE}:")
    held = held_mtp_layers(declared, folder)
    return dataclasses.replace(declared, mtp_layers=held) if held != getattr(declared, "mtp_layers", 0) else declared


def held_mtp_layers(args, folder: str | Path) -> int:
    """How many of the multi-token prediction layers `args` declares (mtp_layers: num_nextn_predict_layers, Qwen's
    mtp_num_hidden_layers) the folder's weights hold, stored as layers past the decoder's (model.layers.N,
    N >= n_layers: DeepSeek-V3's layer 61, GLM-4.5's), as mtp.layers.J (Qwen3.5's, Qwen3-Next's) or as mtp.J
    (DeepSeek-V4's). A folder saved by transformers declares them but holds none (transformers builds no MTP layer
    and leaves them out): its model then has none. Said once, by the run's start-up (mtp_note), not here: the
    launcher's check, each worker, `convert` and `generate` all read the folder."""
    mtp = getattr(args, "mtp_layers", 0)
    names = stored_tensor_names(folder) if mtp else None
    if not mtp or names is None:
        return mtp
    layers = {name.split(".")[2] for name in names if name.startswith("model.layers.")}
    own = {depth.group(1) for name in names if (depth := re.match(r"(?:model\.)?mtp\.(?:layers\.)?(\d+)\.", name))}
    return next((k for k in range(mtp) if str(args.n_layers + k) not in layers and str(k) not in own), mtp)


def mtp_note(folder: str | Path, run_mtp_layers: int) -> str | None:
    """What the run's start-up says of a Hugging Face folder's multi-token prediction layers, or None where its
    config.json declares none: that the run (`run_mtp_layers` depths) trains the layers its weights hold, or that it
    holds none of those its config.json declares, so the run has no multi-token prediction."""
    declared = args_from_hf_config(read_config(folder), f"{Path(folder) / CONFIG_FILE}:")
    mtp = getattr(declared, "mtp_layers", 0)
    if not mtp:
        return None
    said = f"{Path(folder) / CONFIG_FILE}'s {_mtp_key(declared)}={mtp}"
    if run_mtp_layers:
        return (
            f"{said}, {run_mtp_layers} layer(s) loaded from the folder (model.mtp_layers = 0 leaves them out of the "
            "run and carries them into its export)"
        )
    if held_mtp_layers(declared, folder):
        return None  # model.mtp_layers = 0: the import's line names the tensors left out and carried
    return f"none: {said}, but the folder holds no such layer's tensors (as transformers saves it)"


def _mtp_key(args) -> str:
    """The config.json key that counts a family's multi-token prediction layers (its arguments' mtp_config_key)."""
    return getattr(args, "mtp_config_key", "num_nextn_predict_layers")


def folder_args(folder: str | Path, seq_len: int):
    """The model of model.flavor = "hf": the shape and math of the folder's config.json, for this run's
    sequence length (learned positions cannot grow; RoPE tables are computed to cover it)."""
    args = folder_model_args(folder)
    if seq_len > args.max_seq_len:
        if spec_of(args).learned_positions:
            raise ConfigError(
                f"training.seq_len={seq_len} is longer than the {args.max_seq_len} learned positions of "
                f"{folder} (n_positions); use training.seq_len <= {args.max_seq_len}"
            )
        args = dataclasses.replace(args, max_seq_len=seq_len)
    return args


def resolve_model_folder(model, explicit: set[str]):
    """With model.flavor = "hf", take model.name (and model.tokenizer, when the folder has a tokenizer.json)
    from model.hf_assets_path, in place; a key set explicitly to something else is an error, not ignored.
    Returns the folder's model arguments."""
    folder = model.hf_assets_path
    if not folder:
        raise ConfigError(
            "model.flavor='hf' takes the model from model.hf_assets_path; set it to a Hugging Face "
            "model folder (config.json, safetensors, tokenizer.json)"
        )
    args = folder_model_args(folder)
    spec = spec_of(args)
    has_tokenizer = (Path(folder) / "tokenizer.json").is_file()
    wanted = {"model.name": spec.name}
    assert spec.hf is not None  # args read from a config.json
    builtin = spec.hf.tokenizer(args)
    if has_tokenizer:
        wanted["model.tokenizer"] = "hf"
    elif builtin is not None:
        wanted["model.tokenizer"] = builtin
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
    return args
