"""Building the model a config describes (a named flavor, or a Hugging Face folder's shape) from its family's
spec. Builders construct on the current default device, so the trainer can build under torch.device("meta")."""

from __future__ import annotations

from titanlite.base.errors import ConfigError
from titanlite.models.common.interface import DecoderModule
from titanlite.models.hf_config import folder_args
from titanlite.models.registry import model_args, spec_of


def build_model(name: str, flavor: str, vocab_size: int, max_seq_len: int, n_layers: int = 0) -> DecoderModule:
    """Build the model on the current default device; parameters are uninitialised
    (titanlite.models.common.init.init_weights fills it through model.init_param)."""
    return model_from_args(model_args(name, flavor, vocab_size, max_seq_len, n_layers))


def model_from_args(args) -> DecoderModule:
    """The family's module (its spec's `model`) built from its arguments."""
    spec = spec_of(args)
    return spec.load(spec.model)(args)


def configured_args(model_cfg, vocab_size: int, seq_len: int):
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


def configured_model(model_cfg, vocab_size: int, seq_len: int) -> DecoderModule:
    """Build configured_args's model on the current default device, parameters uninitialised."""
    return model_from_args(configured_args(model_cfg, vocab_size, seq_len))
