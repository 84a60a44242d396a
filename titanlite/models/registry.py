"""The registry of model families: one line per family below, each a folder under titanlite/models/ whose
spec (titanlite/models/spec.py) everything else asks. Torch-free. Families defined outside titanlite register
through model.custom_import (a module that calls `register` when imported)."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from titanlite.base.errors import ConfigError
from titanlite.models import (
    deepseek_v3,
    deepseek_v4,
    falcon_h1,
    gemma3,
    gemma4,
    glm4_moe,
    gpt2,
    gpt_oss,
    granitemoehybrid,
    kimi_linear,
    llama3,
    minimax_m2,
    mistral,
    mixtral,
    nemotron_h,
    olmo2,
    olmo3,
    olmo_hybrid,
    olmoe,
    qwen2,
    qwen3,
    qwen3_5,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
    smollm3,
)
from titanlite.models.deepseek_v3 import deepseek_v32, glm_moe_dsa  # DeepSeek-V3's folder's sparse-attention families
from titanlite.models.gemma4 import moe_family as gemma4_moe  # Gemma 4's MoE sizes, a family of gemma4's folder
from titanlite.models.spec import ModelSpec

_SPECS: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> None:
    """Make `spec` a model.name (a second spec of the same name replaces the first: re-imports are harmless)."""
    _SPECS[spec.name] = spec


for _family in (
    gpt2,
    llama3,
    smollm3,
    qwen2,
    qwen3,
    olmo2,
    mistral,
    qwen3_moe,
    olmoe,
    mixtral,
    gemma3,
    gemma4,
    gemma4_moe,
    gpt_oss,
    deepseek_v3,
    deepseek_v32,
    qwen3_5,
    qwen3_5_moe,
    kimi_linear,
    qwen3_next,
    olmo_hybrid,
    glm4_moe,
    glm_moe_dsa,
    olmo3,
    minimax_m2,
    nemotron_h,
    falcon_h1,
    granitemoehybrid,
    deepseek_v4,
):
    register(_family.SPEC)


def import_custom(module: str) -> None:
    """Import the module of model.custom_import, which registers its families."""
    if not module:
        return
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"model.custom_import={module!r} cannot be imported: {e}") from e


def names() -> list[str]:
    return list(_SPECS)


def spec_named(name: str) -> ModelSpec:
    if name not in _SPECS:
        raise ConfigError(f"model.name={name!r} is not a known model; use one of: {', '.join(_SPECS)}")
    return _SPECS[name]


def spec_of(args: Any) -> ModelSpec:
    """The spec a model's arguments belong to (their `family`)."""
    return spec_named(args.family)


def spec_of_model_type(model_type: str | None, where: str) -> ModelSpec:
    """The spec that reads a config.json of this model_type."""
    for spec in _SPECS.values():
        if spec.hf is not None and model_type in (spec.hf.model_type, *spec.hf.also_reads):
            return spec
    # Each model_type once (two families may read one: gemma4_text with and without experts), the ones a family also
    # reads (a multimodal folder's: gemma4, qwen3_5) after its own.
    known = ", ".join(
        dict.fromkeys(repr(t) for s in _SPECS.values() if s.hf for t in (s.hf.model_type, *s.hf.also_reads))
    )
    raise ConfigError(f"{where} model_type={model_type!r} is not supported; titanlite reads {known}")


def families_of_flavor(flavor: str) -> list[str]:
    """The families (model.name) that have a flavor of this name."""
    return [name for name, spec in _SPECS.items() if flavor in spec.flavors]


def pad_vocab(vocab_size: int, multiple: int = 64) -> int:
    """Round the vocabulary up to a multiple of 64: fewer odd matmul shapes on GPUs."""
    return -(-vocab_size // multiple) * multiple


def model_args(name: str, flavor: str, vocab_size: int, max_seq_len: int, n_layers: int = 0):
    """The arguments of model `name` at size `flavor` for this tokenizer and sequence length
    (n_layers > 0 overrides the flavor's depth)."""
    spec = spec_named(name)
    if flavor not in spec.flavors:
        raise ConfigError(
            f"model.flavor={flavor!r} is not a {name} flavor; use one of: {', '.join(spec.flavors)}, "
            "or 'hf' with model.hf_assets_path"
        )
    if vocab_size <= 0:
        raise ConfigError(f"vocab_size={vocab_size} must be positive")
    if max_seq_len <= 0:
        raise ConfigError(f"training.seq_len={max_seq_len} must be positive")
    base = spec.flavors[flavor]
    if base.vocab_size and vocab_size > base.vocab_size:
        raise ConfigError(
            f"model.flavor={flavor!r} embeds {base.vocab_size} token ids, fewer than the tokenizer's {vocab_size}; "
            "use the model's own tokenizer (model.tokenizer = 'hf' with its folder), or one with fewer ids"
        )
    try:  # a depth the family's arguments refuse (a layer pattern it cannot hold) is the user's, in one line
        depth = spec.with_depth(base, n_layers) if n_layers else {}
        # Positions (learned, or RoPE tables) must cover the training sequence length.
        return dataclasses.replace(
            base,
            vocab_size=base.vocab_size or pad_vocab(vocab_size),
            max_seq_len=max(base.max_seq_len, max_seq_len),
            **depth,
        )
    except ValueError as e:
        if not n_layers:
            raise
        raise ConfigError(
            f"model.n_layers={n_layers} does not fit model {name} {flavor}: {e}; set another depth, or leave "
            "model.n_layers out"
        ) from None
