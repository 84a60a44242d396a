"""Model flavors by name, and the model a config describes (a named flavor, or a Hugging Face folder's shape).
Builders construct on the current default device, so the trainer can build under torch.device("meta")."""

from __future__ import annotations

import dataclasses

from titanlite.base.errors import ConfigError
from titanlite.base.flavors import FLAVORS
from titanlite.base.hf_config import folder_args
from titanlite.base.model_args import GPT2Args, LlamaArgs, ModelArgs
from titanlite.models.gpt2 import GPT2
from titanlite.models.interface import Decoder
from titanlite.models.llama import Llama

# The module class of each family's arguments: a new family is a new module and one entry here.
MODEL_CLASSES = {GPT2Args: GPT2, LlamaArgs: Llama}


def pad_vocab(vocab_size: int, multiple: int = 64) -> int:
    """Round the vocabulary up to a multiple of 64: fewer odd matmul shapes on GPUs."""
    return -(-vocab_size // multiple) * multiple


def model_args(name: str, flavor: str, vocab_size: int, max_seq_len: int, n_layers: int = 0):
    """The arguments of model `name` at size `flavor` for this tokenizer and sequence length
    (n_layers > 0 overrides the flavor's depth)."""
    if name not in FLAVORS:
        raise ConfigError(f"model.name={name!r} is not a known model; use one of: {', '.join(FLAVORS)}")
    if flavor not in FLAVORS[name]:
        raise ConfigError(
            f"model.flavor={flavor!r} is not a {name} flavor; use one of: {', '.join(FLAVORS[name])}, "
            "or 'hf' with model.hf_assets_path"
        )
    if vocab_size <= 0:
        raise ConfigError(f"vocab_size={vocab_size} must be positive")
    if max_seq_len <= 0:
        raise ConfigError(f"training.seq_len={max_seq_len} must be positive")
    base = FLAVORS[name][flavor]
    if base.vocab_size and vocab_size > base.vocab_size:
        raise ConfigError(
            f"model.flavor={flavor!r} embeds {base.vocab_size} token ids, fewer than the tokenizer's {vocab_size}; "
            "use the model's own tokenizer (model.tokenizer = 'hf' with its folder), or one with fewer ids"
        )
    depth = {}
    if n_layers:
        depth["n_layers"] = n_layers
        if isinstance(base, LlamaArgs) and base.nope_layers:  # keep the NoPE pattern for the new depth
            interval = base.nope_layers[0] + 1
            depth["nope_layers"] = tuple(i for i in range(n_layers) if (i + 1) % interval == 0)
    # Positions (learned for GPT-2, RoPE tables for Llama) must cover the training sequence length.
    return dataclasses.replace(
        base,
        vocab_size=base.vocab_size or pad_vocab(vocab_size),
        max_seq_len=max(base.max_seq_len, max_seq_len),
        **depth,
    )


def build_model(name: str, flavor: str, vocab_size: int, max_seq_len: int, n_layers: int = 0) -> Decoder:
    """Build the model on the current default device; parameters are uninitialised
    (titanlite.models.init.init_weights fills it through model.init_param)."""
    return model_from_args(model_args(name, flavor, vocab_size, max_seq_len, n_layers))


def model_from_args(args: ModelArgs) -> Decoder:
    return MODEL_CLASSES[type(args)](args)


def configured_args(model_cfg, vocab_size: int, seq_len: int) -> ModelArgs:
    """The [model] section's model for a tokenizer of vocab_size ids and training.seq_len: a named flavor,
    or with flavor "hf" the shape of the Hugging Face folder model.hf_assets_path, vocabulary unpadded."""
    m = model_cfg
    if m.flavor != "hf":
        return model_args(m.name, m.flavor, vocab_size, seq_len, m.n_layers)
    args = folder_args(m.hf_assets_path, seq_len)
    if vocab_size > args.vocab_size:
        raise ConfigError(
            f"model.tokenizer={m.tokenizer!r} has {vocab_size} ids but {m.hf_assets_path} embeds "
            f"{args.vocab_size}; use the folder's own tokenizer (leave model.tokenizer out)"
        )
    return args


def configured_model(model_cfg, vocab_size: int, seq_len: int) -> Decoder:
    """Build configured_args's model on the current default device, parameters uninitialised."""
    return model_from_args(configured_args(model_cfg, vocab_size, seq_len))
