"""A Hugging Face model folder's config.json: reading it, and the one-line refusal of a field titanlite does not
build. Torch-free. Each family's own fields are its folder's (titanlite/models/<family>/); the dispatch by
model_type is titanlite/models/hf_config.py's."""

from __future__ import annotations

import json
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


def check_no_unsupported(config: dict, where: str, experts: bool = False) -> None:
    """Refuse the fields titanlite does not implement in any family (quantization), and the mixture-of-experts
    fields in a family whose MLPs are dense (experts=False)."""
    for key in () if experts else _MOE_FIELDS:
        if config.get(key):
            raise refuse(where, key, config[key], f"a {config.get('model_type')} model has dense MLPs, no experts")
    quantization = config.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        raise ConfigError(
            f"{where} quantization_config (quant_method {method!r}) is not supported: titanlite reads unquantized "
            "weights only (float32 or bfloat16); use a dequantized copy of the checkpoint (e.g. FP8 or MXFP4 to "
            "bfloat16)"
        )
