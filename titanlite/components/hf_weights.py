"""Hugging Face weights: our state dict to a folder `transformers` loads (config.json, safetensors, tokenizer
files), and a folder's safetensors into a run's model, read one tensor at a time, so a sharded layout never
holds more than one full parameter. Before launch (`check_hf_folders`, `check_hf_values`) a folder is refused in
one line for what its load would refuse: tensors of another name, shape or dtype than its config.json makes,
NaN or infinite values, a config.json that trains with dropout. A family's weight names and layouts are its
folder's (its spec's hf_weights), config.json is titanlite/models/hf_config.py's; safetensors is imported where it
is used (an optional dependency: pip install '.[hf]')."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from titanlite.base.command_line import check_writable_place
from titanlite.base.errors import ConfigError
from titanlite.base.hf_config import CONFIG_FILE, check_training_fields, quantization_of, read_config, read_json
from titanlite.components.hf_quantized import QuantizedTensors, check_unconfigured_scales
from titanlite.components.hf_tokenizer import save_tokenizer
from titanlite.models.build import model_from_args
from titanlite.models.common.init import canonical_name, fill_parameters
from titanlite.models.common.interface import unwrapped
from titanlite.models.hf_config import folder_model_args, hf_config
from titanlite.models.registry import spec_of
from titanlite.models.spec import math_fields

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"
EXPORT_RECORD = "titanlite_export.json"  # the files an export wrote: what a later export into the folder may replace


def check_export_folder(folder: str | Path, option: str = "convert to-hf --output") -> None:
    """Refuse, before any work, a folder an export may not write: a file, a path under a file, or a folder holding
    files that no titanlite export wrote (another model's: an export never deletes or overwrites what it did not
    write). A new or empty folder, or one earlier export's, is fine."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{option} {folder} is a file; name a new or empty folder")
    check_writable_place(folder, f"{option} {folder}")
    if not folder.is_dir():
        return
    ours = set(_exported_files(folder))
    others = sorted(p.name for p in folder.iterdir() if p.name not in ours and p.name != EXPORT_RECORD)
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise ConfigError(
            f"{option} {folder} holds files no titanlite export wrote ({shown}); an export replaces only its own "
            "files, so name a new or empty folder"
        )


def _exported_files(folder: Path) -> list[str]:
    """The files the folder's last titanlite export wrote (its EXPORT_RECORD); [] where there is none."""
    record = folder / EXPORT_RECORD
    if not record.is_file():
        return []
    try:
        files = json.loads(record.read_text()).get("files", [])
    except (ValueError, OSError, AttributeError):
        return []
    return [f for f in files if isinstance(f, str) and "/" not in f and f not in ("", ".", "..")]


# Non-parameter entries some HF checkpoints carry (old causal-mask buffers, old RoPE tables).
_HF_BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _names(args):
    """The family's weight-name module (its spec's hf_weights): hf_sources, hf_keys, to_hf, from_hf_tensor."""
    spec = spec_of(args)
    if not spec.hf_weights:
        raise ConfigError(f"model.name={spec.name!r} has no Hugging Face weight names to import or export")
    return spec.load(spec.hf_weights)


def _take(sd: dict, name: str, what: str) -> torch.Tensor:
    if name not in sd:
        raise ConfigError(f"{what} has no {name!r}; it does not match the model's configuration")
    return sd[name]


def to_hf(args, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict -> HF names and layouts. lm_head.weight is always present (equal to the embedding
    when tied, as in HF's own state_dict()); save_hf drops it for tied models."""
    tied = args.tie_embeddings

    def take(name: str) -> torch.Tensor:
        return _take(state_dict, "tok_embeddings.weight" if tied and name == "output.weight" else name, "state dict")

    return _names(args).to_hf(args, state_dict, take)


def _hf_keys(args, keys) -> dict[str, str]:
    """Our view of a folder's tensor names (non-parameter buffers and carried tensors dropped), mapped to the stored
    name."""
    carried = set(hf_carried(args, keys))
    return _names(args).hf_keys(args, [k for k in keys if not k.endswith(_HF_BUFFER_SUFFIXES) and k not in carried])


def hf_carried(args, keys) -> list[str]:
    """The tensors of a folder that are not the model's but belong with it (a multimodal folder's vision tower, its
    multi-token-prediction layers): never trained, carried unchanged into an export of a run that started from the
    folder. A family names them with its weights module's `hf_carried(args, keys)`; none where it has no such hook."""
    module = _names(args)
    return list(module.hf_carried(args, list(keys))) if hasattr(module, "hf_carried") else []


def hf_sources(args) -> dict[str, str | tuple[str, ...]]:
    """Our parameter name -> the Hugging Face tensor it is made from (a tied output.weight from the embedding,
    as it is the same tensor), or the tensors, in order, of a parameter stacked from several (a mixture of
    experts' per-expert weights)."""
    names = dict(_names(args).hf_sources(args))
    if args.tie_embeddings:
        names["output.weight"] = names["tok_embeddings.weight"]
    return names


def from_hf_tensor(args, name: str, hf: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """Our parameter `name`'s full value from its Hugging Face tensor, or tensors (hf_sources[name])."""
    return _names(args).from_hf_tensor(args, name, hf)


def _first(source: str | tuple[str, ...]) -> str:
    return source if isinstance(source, str) else f"{source[0]} (and {len(source) - 1} more)"


def _read(source: str | tuple[str, ...], get) -> torch.Tensor | list[torch.Tensor]:
    """The tensor a source names, or the list of those a stacked parameter's names (`get(hf_name)` reads one)."""
    return get(source) if isinstance(source, str) else [get(one) for one in source]


def _flat(sources: dict[str, str | tuple[str, ...]]) -> set[str]:
    return {one for source in sources.values() for one in ((source,) if isinstance(source, str) else source)}


def from_hf(args, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF names and layouts -> our state dict, ready for model.load_state_dict(strict=True).

    A tied model's state_dict() lists the shared tensor as both tok_embeddings.weight and output.weight,
    so both keys are returned (the same tensor); HF's lm_head.weight, saved or not, is then ignored."""
    keys = _hf_keys(args, hf_state_dict)
    sources = hf_sources(args)
    _check_tensor_names(args, keys, sources, "Hugging Face state dict")
    out = {
        name: from_hf_tensor(args, name, _read(hf, lambda one: hf_state_dict[keys[one]]))
        for name, hf in sources.items()
        if not (args.tie_embeddings and name == "output.weight")
    }
    if args.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def _check_tensor_names(args, keys: dict[str, str], sources: dict[str, str | tuple[str, ...]], what: str) -> None:
    """Every tensor the model needs is there, and nothing else (a tied model's lm_head.weight may be)."""
    needed = _flat(sources)
    missing = sorted(needed - set(keys))
    if missing:
        raise ConfigError(f"{what} has no {missing[0]!r}; it does not match the model's configuration")
    unknown = sorted(set(keys) - needed - ({"lm_head.weight"} if args.tie_embeddings else set()))
    if unknown:
        raise ConfigError(f"{what} has {len(unknown)} unexpected tensors, e.g. {unknown[0]!r}")


def save_hf(
    folder: str | Path,
    args,
    state_dict: dict[str, torch.Tensor],
    dtype: torch.dtype = torch.float32,
    tokenizer=None,
    max_shard_bytes: int = 5 * 2**30,
    carry_from: str | Path | None = None,
    quantized: bool = False,
    evaluation: dict | None = None,
) -> None:
    """Write config.json, generation_config.json, the weights cast to `dtype` and (given a tokenizer) its
    files to `folder` (created if needed), so that AutoModelForCausalLM and AutoTokenizer load it offline.

    `carry_from`: the Hugging Face folder the run started from. Its carried tensors (hf_carried: a vision tower,
    multi-token-prediction layers) go into the export unchanged, in their stored dtype, and where the family lays the
    folder out otherwise (a multimodal folder: the family's `hf_folder` hook) the export keeps that layout and the
    folder's config.json with the trained model's fields in it, so the export loads as the folder did. `quantized`
    (with `carry_from` an fp8 folder): the weights it held in FP8 blocks are written so again, scales computed from
    the trained values, and its quantization_config kept. `evaluation`: the run's evaluation settings, kept in the
    export's record so that `titanlite eval` of the folder covers the run's windows (export_evaluation).

    Weights over max_shard_bytes are split into model-0000i-of-0000n.safetensors files listed by
    model.safetensors.index.json, as save_pretrained does. A tied model's lm_head.weight is left out, as
    save_pretrained does: safetensors refuses tensors that share memory, and transformers re-ties it on load.

    All or nothing: the files are written into a staging folder beside `folder` and moved in once every one is
    written; a refusal (a model its family's config.json cannot express) or a failed write (a full disk) leaves
    `folder` as it was, with no staging folder or new parent folder behind."""
    folder = Path(folder)
    check_export_folder(folder)
    new_parents = [p for p in folder.parents if not p.exists()]  # deepest first, removed again on failure
    staging = folder.parent / f".{folder.name}.export-in-progress"
    try:
        if staging.exists():  # an export killed while writing (nothing of it reached `folder`)
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
        _write_export(staging, args, state_dict, dtype, tokenizer, max_shard_bytes, carry_from, quantized, evaluation)
        folder.mkdir(exist_ok=True)
        for stale in _exported_files(folder):  # a re-export leaves no file of the earlier one (shards of another count)
            (folder / stale).unlink(missing_ok=True)
        for file in staging.iterdir():
            file.replace(folder / file.name)
        staging.rmdir()
    except BaseException as e:
        shutil.rmtree(staging, ignore_errors=True)
        for parent in new_parents:
            with contextlib.suppress(OSError):
                parent.rmdir()
        if isinstance(e, OSError):
            why = e.strerror or e
            raise ConfigError(f"could not write the export to {folder} ({why}); nothing was written") from None
        raise


def _write_export(
    folder: Path,
    args,
    state_dict: dict[str, torch.Tensor],
    dtype: torch.dtype,
    tokenizer,
    max_shard_bytes: int,
    carry_from: str | Path | None = None,
    quantized: bool = False,
    evaluation: dict | None = None,
) -> None:
    """save_hf's files, into the new folder `folder`."""
    from safetensors.torch import save_file  # optional dependency (the [hf] extra)

    token_ids = {}
    if tokenizer is not None:
        token_ids = save_tokenizer(folder, tokenizer, args.max_seq_len)
    config = hf_config(args, _dtype_name(dtype), token_ids)  # before the weights: a refusal costs no writing
    hf = to_hf(args, state_dict)
    if args.tie_embeddings:
        del hf["lm_head.weight"]
    # clone: no entry may share storage with another (or stay a view of the live model's parameters).
    tensors = {k: v.detach().to(device="cpu", dtype=dtype).contiguous().clone() for k, v in hf.items()}
    if carry_from is not None:
        config, tensors = _carry(carry_from, args, config, tensors, quantized, dtype)
    elif quantized:
        raise ConfigError(
            "checkpoint.export_quantized writes the FP8 blocks of the Hugging Face folder a run started from, and this "
            "run started from none (fresh weights or a DCP checkpoint); leave it out"
        )
    shards = _shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    else:
        weight_map: dict[str, str] = {}
        for i, names in enumerate(shards, start=1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file({k: tensors[k] for k in names}, str(folder / file), metadata={"format": "pt"})
            weight_map |= dict.fromkeys(names, file)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = {**{k: v for k, v in token_ids.items() if v is not None}, "do_sample": False}
    (folder / GENERATION_CONFIG_FILE).write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
    # Every file of the export's folder will be this export's (check_export_folder refused a folder with any other):
    # recorded for the next.
    written = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != EXPORT_RECORD)
    record = {"files": written, **({"evaluation": evaluation} if evaluation else {})}
    (folder / EXPORT_RECORD).write_text(json.dumps(record, indent=1) + "\n")


def export_evaluation(folder: Path) -> dict[str, Any]:
    """The evaluation settings of the run a titanlite export came from (save_hf's `evaluation`); {} for any other
    folder, or a record that cannot be read (it only saves repeating flags)."""
    try:
        record = json.loads((folder / EXPORT_RECORD).read_text())
    except (OSError, ValueError):
        return {}
    settings = record.get("evaluation") if isinstance(record, dict) else None
    return dict(settings) if isinstance(settings, dict) else {}


def _carry(
    source: str | Path,
    args,
    config: dict,
    tensors: dict[str, torch.Tensor],
    quantized: bool = False,
    dtype: torch.dtype = torch.float32,
) -> tuple[dict, dict[str, torch.Tensor]]:
    """The export's config.json and tensors in the layout of the folder `source` the run started from (the family's
    hf_folder hook, where its folders have one of their own), with the folder's carried tensors added unchanged;
    `quantized`: the tensors the folder held in FP8 blocks (or DeepSeek-V4's fp4 experts) quantized so again, in the
    folder's format, its quantization_config kept."""
    source = Path(source)
    if not (source / CONFIG_FILE).is_file():
        raise ConfigError(
            f"{source}, the Hugging Face folder this run started from, is gone; an export carries its tensors the "
            "model does not train (a vision tower, multi-token prediction): put the folder back there"
        )
    reader = WeightReader(source)
    carried = hf_carried(args, reader.keys())
    check_carried(args, reader, config_shapes(args))
    module = _names(args)
    if hasattr(module, "hf_folder"):
        config, tensors = module.hf_folder(args, config, tensors, read_config(source))
    if quantized and (reader.quantization is None or reader.quantization["method"] != "fp8"):
        raise ConfigError(
            f"checkpoint.export_quantized writes the FP8 blocks of the folder a run started from, and {source} "
            "is not an fp8 folder; leave it out"
        )
    carried_tensors: dict[str, torch.Tensor] = {}
    dequantized = [name for name in carried if name in reader.logical.names]
    for name in carried:
        if name in reader.logical.names and quantized:  # as stored: the values and their scales, bit for bit
            carried_tensors |= {raw: reader.stored(raw) for raw in reader.logical.names[name]}
        elif name in reader.logical.names:  # the export is not quantized: neither may these be
            carried_tensors[name] = reader.get(name).to(dtype)
        else:  # as stored, unchecked: not the model's, and a tower may hold infinities (clip bounds) on purpose
            carried_tensors[name] = reader.stored(name)
    if dequantized and not quantized:
        logger.info(
            f"  export: {len(dequantized)} carried tensors held in {reader.logical.method} in {source} are "
            f"written dequantized to {_dtype_name(dtype).lower()}, as the export's weights are "
            "(checkpoint.export_quantized keeps them as stored)"
        )
    if quantized:
        tensors = _quantized_again(args, reader, tensors)
        quantization = read_config(source)["quantization_config"]
        # The published DeepSeek-V4 folders' expert_dtype is at config.json's top level: the export's says it here.
        expert_dtype = (reader.quantization or {}).get("expert_dtype")
        if expert_dtype:
            quantization = {**quantization, "expert_dtype": expert_dtype}
        config = {**config, "quantization_config": quantization}
    return config, tensors | carried_tensors


def _quantized_again(args, reader: WeightReader, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The export's tensors with those the folder `reader` held quantized quantized again in its format (their scales
    beside them, named as the folder names its own), in the export's names (`tensors` is in transformers', which
    may not be the folder's: DeepSeek-V4's published folders name the top level without "model.")."""
    stored = {name: raw for name, raw in _hf_keys(args, reader.keys()).items() if raw in reader.logical.names}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        out |= reader.logical.quantize(stored[name], name, tensor) if name in stored else {name: tensor}
    return out


def export_loads(folder: str | Path, dtype: str) -> tuple[str, str]:
    """For the last line of an export to `folder` in `dtype`: what its weights are ("float32", or "fp8 (e4m3) in 128 x
    128 blocks, the other weights float32" for checkpoint.export_quantized's), and what transformers needs to load it.
    An fp8 folder needs accelerate (transformers 5's fp8 quantizer refuses to start without it) and, where fp8 is not
    run (a CPU), whole blocks: its dequantizer takes a weight's block size from its scales' grid (rows // grid rows), so
    a weight of more than one block ending in a partial one is refused, or read wrong where its size divides by its
    count of blocks (200 rows in 128-row blocks: read as two blocks of 100)."""
    quantization = quantization_of(read_config(folder), f"{Path(folder) / CONFIG_FILE}:")
    if quantization is None or quantization["method"] != "fp8":
        return dtype, "AutoModelForCausalLM and AutoTokenizer load it offline"
    reader = WeightReader(folder)
    rows, cols = reader.logical.block
    fp4 = ", the experts fp4 (e2m1, a power-of-two scale per 32)" if "fp4" in reader.logical.kinds.values() else ""
    what = f"fp8 (e4m3) in {rows} x {cols} blocks{fp4}, the other weights {dtype}"
    shapes = {name: reader.header(name)[1] for name, kind in reader.logical.kinds.items() if kind == "fp8"}
    # One block along a dimension is read right whatever its size (the grid's one row is the weight's rows).
    partial = [(n, shape) for n, shape in shapes.items() if any(s > b and s % b for s, b in zip(shape, (rows, cols)))]
    if not partial:
        return what, (
            "AutoTokenizer loads it offline, and AutoModelForCausalLM with accelerate installed (transformers' fp8 "
            "reader needs it: pip install accelerate)"
        )
    (name, shape), count = partial[0], len(partial)
    return what, (
        "AutoTokenizer loads it offline, and AutoModelForCausalLM with accelerate installed (pip install accelerate), "
        f"but on a CPU transformers 5 dequantizes whole {rows} x {cols} blocks only and {count} of its fp8 weights "
        f"end{'s' * (count == 1)} in partial blocks (e.g. {name!r} {shape}), which it refuses or reads wrong: for "
        "transformers on a CPU, export without checkpoint.export_quantized"
    )


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Tensor names in file order, cut into groups of at most max_bytes (a larger tensor gets its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _weight_files(folder: Path) -> tuple[list[Path], dict[str, Path]]:
    """model.safetensors (as transformers, read whether or not an index is beside it), or the shards that
    model.safetensors.index.json names, in name order; with the index's weight_map, the file each tensor it names is
    read from ({} without an index)."""
    if (folder / WEIGHTS_FILE).is_file():
        return [folder / WEIGHTS_FILE], {}
    index = folder / INDEX_FILE
    if not index.is_file():
        raise ConfigError(f"{folder} has neither {WEIGHTS_FILE} nor {INDEX_FILE}")
    content = read_json(index)
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConfigError(f"{index} has no weight_map; the index is damaged: download the folder again")
    for name, file in weight_map.items():
        if not (isinstance(file, str) and file not in ("", ".", "..") and "/" not in file and "\\" not in file):
            raise ConfigError(
                f"{index}: weight_map[{name!r}] is {file!r}, not a safetensors file of the folder (a file name beside "
                "the index); the index is damaged: download the folder again"
            )
    paths = {name: folder / file for name, file in weight_map.items()}
    files = sorted(set(paths.values()))
    for path in files:
        if not path.is_file():
            raise ConfigError(
                f"{path} is listed in {index} but does not exist; the folder is incomplete: download that file again"
            )
    return files, paths


class WeightReader:
    """The tensors of a folder's safetensors file(s), read one at a time (never the whole model at once)."""

    def __init__(self, folder: str | Path):
        from safetensors import safe_open  # optional dependency (the [hf] extra)

        self.folder = Path(folder)
        self.files = {}
        files, indexed = _weight_files(self.folder)
        held: dict[str, list[Path]] = {}  # each stored tensor's files, in name order
        for path in files:
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types for damaged files
                raise ConfigError(f"cannot read {path}: {e}; the file is damaged or not safetensors") from e
            self.files[path] = handle
            for name in handle.keys():
                held.setdefault(name, []).append(path)
        # Tensors stored in more than one file: (name, the file read, the other), identical copies, and copies of other
        # values the index resolves (said as the folder is loaded: _say_conversions).
        self.copies: list[tuple[str, Path, Path]] = []
        self.overridden: list[tuple[str, Path, Path]] = []
        self.where: dict[str, Path] = self._files_read(held, indexed)
        config = self.folder / CONFIG_FILE
        self.quantization = quantization_of(read_config(self.folder), f"{config}:") if config.is_file() else None
        if self.quantization is None:
            check_unconfigured_scales(list(self.where), self.stored_header, self.folder, config)
        # A quantized folder's weights and their scales read as one logical tensor each (hf_quantized.py).
        self.logical = QuantizedTensors(
            self.quantization, list(self.where), self.stored_header, self.folder, lambda name: self.where[name].name
        )

    def _files_read(self, held: dict[str, list[Path]], indexed: dict[str, Path]) -> dict[str, Path]:
        """The file each tensor is read from: the one the index names (as its weight_map says, whatever other file
        holds a copy), else the only one that holds it. An index entry whose file does not hold the tensor is refused,
        and so are copies of other values that the index does not resolve: one parameter cannot take two values."""
        for name, path in indexed.items():
            if path not in held.get(name, []):
                others = [p.name for p in held.get(name, [])]
                holder = f"{others[0]} holds it" if others else "no file of the folder holds it"
                raise ConfigError(
                    f"{self.folder / INDEX_FILE}: weight_map puts {name!r} in {path.name}, which does not hold it "
                    f"({holder}); the index does not match its files: download the folder again"
                )
        where: dict[str, Path] = {}
        for name, paths in held.items():
            read = indexed.get(name, paths[0])
            for other in paths:
                if other == read:
                    continue
                if self._same(name, read, other):
                    self.copies.append((name, read, other))
                elif name in indexed:
                    self.overridden.append((name, read, other))
                else:
                    raise ConfigError(
                        f"{self.folder}: tensor {name!r} is stored in both {read.name} and {other.name} with different "
                        f"values, and {INDEX_FILE} does not name either; one parameter cannot take two values: remove "
                        "the wrong copy, or name the right file in the index's weight_map"
                    )
            where[name] = read
        return where

    def _same(self, name: str, one: Path, other: Path) -> bool:
        """Whether the copies of tensor `name` in files `one` and `other` are the same, bit for bit."""
        views = [self.files[path].get_slice(name) for path in (one, other)]
        if len({(view.get_dtype(), tuple(view.get_shape())) for view in views}) > 1:
            return False
        first, second = (self.files[path].get_tensor(name).reshape(-1).view(torch.uint8) for path in (one, other))
        return torch.equal(first, second)

    def keys(self) -> list[str]:
        """The folder's tensors as the model reads them: a quantized weight once, its scales not listed."""
        return self.logical.keys()

    def stored_header(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype, e.g. "BF16"; shape) of a stored tensor, from its file's header: nothing is read."""
        view = self.files[self.where[name]].get_slice(name)
        return view.get_dtype(), tuple(view.get_shape())

    def header(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(dtype as stored: "BF16", or "FP8" / "MXFP4" for a quantized weight read with its scales; the shape the model
        reads) of a tensor of keys(), a quantized one's scales checked: nothing is read."""
        return self.logical.logical_header(name)

    def get(self, name: str, rows: range | None = None) -> torch.Tensor:
        """The tensor (a quantized one dequantized to float32), or its rows `rows` of the first dimension (only they
        are read), refused in one line naming it if a value is NaN or infinite (training would take it to a NaN loss
        that reads as a learning-rate problem)."""
        tensor = self.logical.read(name, self._stored, rows)
        stored = self.logical.names.get(name, (name,))[0]
        check_finite(tensor, stored, self.where[stored])
        return tensor

    def stored(self, name: str) -> torch.Tensor:
        """A stored tensor as it is in its file (a quantized weight's raw values, or its scales), unchecked."""
        return self._stored(name)

    def _stored(self, name: str, rows: range | None = None) -> torch.Tensor:
        handle = self.files[self.where[name]]
        if rows is None:
            return handle.get_tensor(name)
        return handle.get_slice(name)[rows.start : rows.stop]

    def nbytes(self) -> int:
        return sum(path.stat().st_size for path in self.files)


def check_finite(tensor: torch.Tensor, name: str, path: Path) -> None:
    """Refuse a NaN or infinite value in tensor `name` of safetensors file `path`, counting them."""
    if not tensor.is_floating_point():
        return
    flat = tensor.reshape(-1)
    if all(torch.isfinite(chunk).all() for chunk in flat.split(2**24)):  # chunks: a bounded temporary
        return
    nan, inf = int(flat.isnan().sum()), int(flat.isinf().sum())
    counts = " and ".join(f"{n:,} {what}" for n, what in ((nan, "NaN"), (inf, "infinite")) if n)
    raise ConfigError(
        f"{path.parent}: tensor {name!r} in {path.name} holds {counts} value{'s' * (nan + inf > 1)}; the weights are "
        "damaged (training from them ends in a NaN loss): download or export the folder again"
    )


def load_hf(folder: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read a Hugging Face model folder whole: (config.json as a dict, every tensor on the CPU)."""
    config = read_config(folder)
    reader = WeightReader(folder)
    return config, {key: reader.get(key) for key in reader.keys()}


# ---- loading a folder into a run's model ------------------------------------------------------------------


def _math(args, field: str):
    """args.field as far as it decides what the weights compute: a block's fields of how the run trains it (its
    TRAINING: an MoE block's balancing, the [moe] section, where a routing bias starts at zero; how the run trains an
    indexer) do not."""
    value = getattr(args, field)
    training = getattr(type(value), "TRAINING", ())  # a block's fields of how the run trains it (MoEArgs, IndexerArgs)
    return dataclasses.replace(value, **{f: getattr(type(value), f) for f in training}) if training else value


# What a float32 parameter holds every value of, in safetensors' names: read into the model without a change
# (bfloat16 and float16 are widened exactly, as training keeps float32 weights). Any other dtype is refused: float64
# would be rounded, and integer or float8 tensors are quantized weights whose scales titanlite does not read.
EXACT_IN_FLOAT32 = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
# The quantized weights a folder's quantization_config declares (hf_quantized.py), dequantized to float32 when read.
QUANTIZED = {"FP8": "fp8 (e4m3)", "FP4": "fp4 (e2m1)", "MXFP4": "mxfp4"}
_KINDS = {"F": "float", "I": "int", "U": "uint"}  # safetensors' I8, U8, F64, F8_E4M3 ... as torch names them
# A folder of at most this many bytes has every value checked before launch (about 3 s a GiB on one core here); a
# larger one is checked as each rank reads it (WeightReader.get), so launching it costs no extra pass.
SCAN_BEFORE_LAUNCH_BYTES = 4 * 2**30


def is_hf_folder(path: str | Path) -> bool:
    return bool(path) and (Path(path) / CONFIG_FILE).is_file()


def check_hf_folders(model_cfg, initial: str, target, training: bool) -> None:
    """Before launch (plan_run): what the Hugging Face folders a run reads would make it refuse or train wrongly.
    A training run refuses a config.json asking for dropout or router noise, in the folder it takes its model from
    (model.flavor = "hf") or its initial weights from (`initial`, when that is a Hugging Face folder). The initial
    weights' folder must then hold the model `target` computes, in tensors of the names, shapes and dtypes its
    config.json makes (headers only: safetensors reads them lazily; the values are check_hf_values')."""
    folders = [model_cfg.hf_assets_path if model_cfg.flavor == "hf" else "", initial]
    for folder in dict.fromkeys(f for f in folders if is_hf_folder(f)):
        if training:
            check_training_fields(read_config(folder), f"{Path(folder) / CONFIG_FILE}:")
    if is_hf_folder(initial):
        source = with_run_mtp_layers(folder_model_args(initial), target)
        _check_compatible(source, target, initial)
        check_tensors(source, WeightReader(initial))


def check_hf_values(folder: str | Path, limit: int = SCAN_BEFORE_LAUNCH_BYTES) -> bool:
    """Before launch (`titanlite check`): read every tensor the model takes from `folder` and refuse a NaN or
    infinite value in one line naming it, when the folder holds at most `limit` bytes. Returns whether it did."""
    reader = WeightReader(folder)
    if reader.nbytes() > limit:
        return False
    for stored in _hf_keys(folder_model_args(folder), reader.keys()).values():
        reader.get(stored)
    return True


def check_tensors(args, reader: WeightReader) -> tuple[dict[str, str], dict[str, str | tuple[str, ...]]]:
    """A folder's tensors are those of the model its config.json gives (`args`): every one it needs and no other,
    each of the shape config.json makes and of a dtype EXACT_IN_FLOAT32 holds. Returns (our view of each tensor's
    name -> its stored name, hf_sources)."""
    keys, sources = _hf_keys(args, reader.keys()), hf_sources(args)
    _check_tensor_names(args, keys, sources, f"{reader.folder}'s safetensors")
    expected = config_shapes(args)
    tables = hf_tables(args)
    refused: dict[str, list[str]] = {}
    for name, stored in keys.items():
        dtype, shape = reader.header(stored)
        if name in tables and (dtype in INTEGER_TABLES or dtype in EXACT_IN_FLOAT32):
            problem = tables[name](reader.get(stored))
            if problem:
                raise ConfigError(f"{reader.folder}: tensor {stored!r}: {problem}")
        elif dtype not in EXACT_IN_FLOAT32 and dtype not in QUANTIZED:
            refused.setdefault(dtype, []).append(stored)
        elif name in expected and shape != expected[name]:
            raise ConfigError(_shape_refusal(args, reader, stored, shape, expected[name]))
    if refused:
        dtype, names = next(iter(refused.items()))
        raise ConfigError(_dtype_refusal(reader, dtype, names))
    check_carried(args, reader, expected)
    return keys, sources


def check_carried(args, reader: WeightReader, shapes: dict[str, tuple[int, ...]]) -> None:
    """The folder's carried tensors (hf_carried) that the family can describe (its weights module's
    `hf_carried_shapes(args, carried, shapes)`: multi-token-prediction layers) have the shapes of this model's
    (`shapes`: config_shapes), or the folder is refused: an export would carry them into a folder of another model."""
    module = _names(args)
    if not hasattr(module, "hf_carried_shapes"):
        return
    carried = hf_carried(args, reader.keys())
    for name, shape in module.hf_carried_shapes(args, carried, shapes).items():
        stored = reader.header(name)[1]
        if stored != tuple(shape):
            raise ConfigError(
                f"{reader.folder}: tensor {name!r}, carried (not trained) into the run's export, has shape {stored}, "
                f"but this model (dim {args.dim}) makes it {tuple(shape)}; it is not of this model's architecture: "
                "remove the tensors it belongs with from the folder, or use the config.json they were saved with"
            )


# The integer dtypes a table of indices may be stored in (hf_tables), read as they are (a float one too, its check
# refusing values that are not whole numbers).
INTEGER_TABLES = ("I64", "I32")


def hf_tables(args) -> dict[str, Callable[[torch.Tensor], str | None]]:
    """The tensors of a folder that are integer tables, not weights (DeepSeek-V4's hash-routed layers' token tables),
    by Hugging Face name, each with the check of its values (a one-line reason, or None): the family's weights
    module's `hf_tables(args)`; none where it has no such hook. They are read and checked before launch."""
    module = _names(args)
    return dict(module.hf_tables(args)) if hasattr(module, "hf_tables") else {}


def config_shapes(args) -> dict[str, tuple[int, ...]]:
    """The shape config.json (read into `args`) makes each Hugging Face tensor: the model built on the meta
    device (no memory), in Hugging Face's names and layouts."""
    with torch.device("meta"):
        state = model_from_args(args).state_dict()
    return {name: tuple(t.shape) for name, t in to_hf(args, state).items()}


def _shape_refusal(args, reader: WeightReader, stored: str, shape: tuple, expected: tuple) -> str:
    rows = shape[1:] == expected[1:] and expected[0] == args.vocab_size
    change = (
        f"set vocab_size to {shape[0]} in config.json if the tensor's rows are the vocabulary, or use"
        if rows
        else "use"
    )
    return (
        f"{reader.folder}: tensor {stored!r} has shape {shape}, but its config.json makes it {expected}"
        + (f" (vocab_size={args.vocab_size})" if rows else "")
        + f"; the weights were not saved with this config.json: {change} the config.json saved with them"
    )


def _dtype_refusal(reader: WeightReader, dtype: str, names: list[str]) -> str:
    name = _KINDS[dtype[0]] + dtype[1:].lower() if dtype[0] in _KINDS and dtype[1].isdigit() else dtype.lower()
    which = f"tensor {names[0]!r} is" if len(names) == 1 else f"tensor {names[0]!r} and {len(names) - 1} more are"
    if dtype == "F64":
        why = "float32 parameters would round the values"
    elif dtype.startswith("F8"):  # fp8 is read with its scales, under a quantization_config saying so (hf_quantized)
        why = (
            "quantized weights; titanlite reads fp8 as e4m3 with a weight_scale_inv per block, in a folder whose "
            "quantization_config says fp8"
        )
    else:
        why = "quantized weights, whose scales titanlite does not read"
    fp8 = ", or give it the weight_scale_inv tensors and quantization_config it was published with"
    return (
        f"{reader.folder}: {which} {name} ({why}); titanlite reads float32, bfloat16 or float16 weights: convert "
        f"the folder to one of them (e.g. bfloat16){fp8 if dtype == 'F8_E4M3' else ''}"
    )


def _check_compatible(source, target, folder) -> None:
    """The configured model (a named flavor) must compute what the folder's does, or the load is refused."""
    if type(source) is not type(target):
        raise ConfigError(
            f"checkpoint.initial_load_path='{folder}' holds a {type(source).__name__.removesuffix('Args')} model, "
            f"but model.name builds a {type(target).__name__.removesuffix('Args')}; set model.flavor = 'hf' and "
            f"model.hf_assets_path = '{folder}' to take the folder's model"
        )
    # Every field the family's arguments call math (models/spec.py math_fields: all but those marked not_math).
    differ = [f for f in math_fields(target) if _math(source, f) != _math(target, f)]
    if spec_of(target).learned_positions and source.max_seq_len != target.max_seq_len:
        differ.append("max_seq_len")
    if source.vocab_size > target.vocab_size:
        differ.append("vocab_size")
    if differ:
        have, want = _in_config_names(source, target, differ)
        raise ConfigError(
            f"checkpoint.initial_load_path='{folder}' has {have}, but the configured model has {want}; set "
            f"model.flavor = 'hf' and model.hf_assets_path = '{folder}' to take the folder's shape"
        )


def _in_config_names(source, target, differ: list[str]) -> tuple[str, str]:
    """The fields in which a folder's model (`source`) and the configured one (`target`) differ, as each would be
    written in config.json ("hidden_size=96"); in the model's own names where config.json could not say the
    configured model (a flavor its family's config.json cannot express) or says no difference."""
    try:
        theirs, ours = hf_config(source), hf_config(target)
    except ConfigError:
        theirs, ours = {}, {}
    unpadded = "vocab_size" not in differ  # a named flavor's larger vocabulary pads the folder's: no difference
    keys = [
        key
        for key in theirs
        if key in ours
        and theirs[key] != ours[key]
        and not (key == "vocab_size" and unpadded)
        and (key != "max_position_embeddings" or "max_seq_len" in differ)
    ]
    keys = [k for k in keys if not isinstance(theirs[k], (dict, list))] or keys  # rope_parameters restates rope_theta
    if keys:
        return ", ".join(f"{k}={theirs[k]}" for k in keys), ", ".join(f"{k}={ours[k]}" for k in keys)

    def named(args) -> str:
        return ", ".join(f"{f}={getattr(args, f)}" for f in differ)

    return named(source), named(target)


def load_hf_into(model_parts: list, folder: str | Path) -> None:
    """Fill a (possibly sharded or pipelined) model from a Hugging Face folder, as a run's starting weights.

    Each parameter is read from the safetensors files, converted and sliced to this rank's shard one at a
    time, so no rank ever holds the whole model. A named flavor's vocabulary may be larger than the
    folder's (GPT-2: 50304 padded of 50257): the extra rows start at zero and are never an input token."""
    models = [unwrapped(part) for part in model_parts]  # DDP names its parameters module.*
    target = models[0].args
    source = with_run_mtp_layers(folder_model_args(folder), target)
    _check_compatible(source, target, folder)
    reader = WeightReader(folder)
    keys, sources = check_tensors(source, reader)
    _check_copies(source, reader)
    _say_conversions(reader, keys, source, target)

    def full_source(name: str) -> torch.Tensor:
        return from_hf_tensor(source, name, _read(sources[name], lambda one: reader.get(keys[one])))

    def full_value(name: str, param: torch.nn.Parameter) -> torch.Tensor:
        value = full_source(name).to(param.dtype)
        if value.shape[0] < param.shape[0] and name in ("tok_embeddings.weight", "output.weight"):
            value = torch.cat([value, value.new_zeros(param.shape[0] - value.shape[0], *value.shape[1:])])
        if value.shape != param.shape:
            raise ConfigError(
                f"{folder}: {_first(sources[name])!r} has shape {tuple(value.shape)}, but the model's {name} "
                f"is {tuple(param.shape)}"
            )
        return value

    def rows_value(name: str, param: torch.nn.Parameter, rows: list[int]) -> torch.Tensor | None:
        # Only the rows this rank keeps of a parameter stacked from several tensors (a mixture's experts, one each)
        # or made row for row from one (the family's hf_rows_stored: gpt-oss's stacked experts).
        made_from = sources[name]
        if not rows:
            return torch.empty((0, *param.shape[1:]), dtype=param.dtype)
        if isinstance(made_from, str):
            if not rows_stored(source, name):
                return None
            runs = [reader.get(keys[made_from], run) for run in _runs(rows)]
            value = from_hf_tensor(source, name, torch.cat(runs) if len(runs) > 1 else runs[0])
        else:
            value = from_hf_tensor(source, name, [reader.get(keys[made_from[i]]) for i in rows])
        return value.to(param.dtype)

    for model in models:
        fill_parameters(model, full_value, rows_value)
        _fill_buffers(model, sources, full_source, folder)


def with_run_mtp_layers(source, target):
    """The folder's model (`source`) as the run takes it: without its multi-token prediction layers where the run
    has none (model.mtp_layers = 0), which then carries them (hf_carried)."""
    if getattr(source, "mtp_layers", 0) and not getattr(target, "mtp_layers", 0):
        return dataclasses.replace(source, mtp_layers=0)
    return source


def hf_copies(args) -> dict[str, str]:
    """A folder's tensors that repeat another one the model shares (DeepSeek-V3's multi-token prediction layers'
    embed_tokens and shared_head.head): stored name -> the shared tensor's. The family's weights module's
    `hf_copies(args)`; none where it has no such hook."""
    module = _names(args)
    return dict(module.hf_copies(args)) if hasattr(module, "hf_copies") else {}


def _check_copies(args, reader: WeightReader) -> None:
    """Each copy (hf_copies) the folder holds equals the tensor the model shares, or the import is refused: one
    parameter cannot take two values, and choosing one would silently drop the other."""
    copies = {copy: shared for copy, shared in hf_copies(args).items() if copy in reader.keys()}
    for copy, shared in copies.items():
        if not torch.equal(reader.get(copy), reader.get(shared)):
            raise ConfigError(
                f"{reader.folder}: {copy!r} differs from {shared!r}, which titanlite's multi-token prediction shares "
                "with the main model (one embedding, one head); set model.mtp_layers = 0 to leave those layers out "
                "(they are then carried unchanged into the export)"
            )
    if copies:
        logger.info(
            f"  checkpoint: {reader.folder}'s multi-token prediction layers hold {len(copies)} copies of the embedding "
            "and head, equal to the model's, which they share (an export writes them again)"
        )


def rows_stored(args, name: str) -> bool:
    """Whether our parameter `name`'s rows are its Hugging Face tensor's, one for one (so a rank reads only the rows
    it keeps): the family's weights module says so with `hf_rows_stored(args, name)`; no parameter where it does not.
    A parameter stacked from several tensors (hf_sources' tuples) always is, one tensor a row."""
    module = _names(args)
    return bool(module.hf_rows_stored(args, name)) if hasattr(module, "hf_rows_stored") else False


def _runs(rows: list[int]) -> list[range]:
    """Ascending `rows` as ranges of consecutive indices."""
    runs: list[range] = []
    for row in rows:
        if runs and runs[-1].stop == row:
            runs[-1] = range(runs[-1].start, row + 1)
        else:
            runs.append(range(row, row + 1))
    return runs


def _say_conversions(reader: WeightReader, keys: dict[str, str], source, target) -> None:
    """One line for each change the load makes, as intended: weights widened to float32, the vocabulary's rows
    padded to a named flavor's (GPT-2's 50257 ids to 50304 rows); and for each oddity of the folder's files it reads
    through: tensors stored in more than one file."""
    if reader.copies:
        name, read, other = reader.copies[0]
        count = len({copy[0] for copy in reader.copies})
        logger.info(
            f"  checkpoint: {reader.folder} stores {count} tensor{'s' * (count > 1)} in more than one file, identical "
            f"copies (e.g. {name!r} in {read.name} and {other.name}): each read once"
        )
    if reader.overridden:
        name, read, other = reader.overridden[0]
        count = len({copy[0] for copy in reader.overridden})
        logger.info(
            f"  checkpoint: {reader.folder} stores {count} tensor{'s' * (count > 1)} again in another file with other "
            f"values (e.g. {name!r} in {other.name}): each read from the file {INDEX_FILE} names (transformers 5 "
            "reads the copy in the file last by name, whatever the index says): remove the stray copies"
        )
    carried = hf_carried(source, reader.keys())
    if carried:
        kinds = sorted({".".join(name.split(".")[:2]) + ".*" for name in carried})
        how = "unchanged"
        if any(name in reader.logical.names for name in carried):
            how = f"(its {reader.logical.method} ones as stored with checkpoint.export_quantized, else dequantized)"
        logger.info(
            f"  checkpoint: {reader.folder} also holds {len(carried)} tensors the model does not train "
            f"({', '.join(kinds)}): left out of the run, carried {how} into its export (convert to-hf)"
        )
    quantized = [q for q in QUANTIZED if q in {reader.header(stored)[0] for stored in keys.values()}]
    if quantized:
        block = reader.quantization.get("block") if reader.quantization else None
        blocks = f" in {block[0]} x {block[1]} blocks" if block else ""
        kinds = [QUANTIZED[q] + (blocks if q == "FP8" else "") for q in quantized]
        logger.info(
            f"  checkpoint: {reader.folder} is quantized ({' and '.join(kinds)}, "
            f"quantization_config): each weight dequantized to float32 as it is read, then to the parameters' dtype"
        )
    tables = hf_tables(source)
    stored_dtypes = {reader.header(stored)[0] for name, stored in keys.items() if name not in tables}
    dtypes = sorted(stored_dtypes - {"F32"} - set(QUANTIZED))
    if dtypes:
        names = " and ".join(EXACT_IN_FLOAT32[d] for d in dtypes)
        logger.info(f"  checkpoint: {reader.folder} holds {names} weights, widened exactly to float32 parameters")
    if target.vocab_size > source.vocab_size:
        logger.info(
            f"  checkpoint: {reader.folder} embeds {source.vocab_size} token ids; the model's rows past them, to its "
            f"vocab_size {target.vocab_size}, start at zero (no token of the tokenizer reads them)"
        )


def _fill_buffers(model, sources: dict, value, folder) -> None:
    """The persistent buffers a folder holds (DeepSeek-V3's routing biases: hf_sources names them beside the
    parameters), copied from `value(name)`, their full value (buffers are not sharded). A non-zero one the model
    has no place for (a block of this model balanced otherwise, [moe] balance) would be silently lost: refused."""
    held = {canonical_name(name): buffer for name, buffer in model.named_buffers()}
    params = {canonical_name(name) for name, _ in model.named_parameters(remove_duplicate=False)}
    for name in sources:
        if name in held:
            held[name].copy_(value(name))
        elif name not in params and _has_parent(model, name) and value(name).count_nonzero():
            raise ConfigError(
                f"{folder} holds non-zero {_first(sources[name])!r}, which this model has no place for (its routing "
                "would ignore them); set moe.balance = 'bias', or leave moe.balance out"
            )


def _has_parent(model, name: str) -> bool:
    try:
        model.get_submodule(name.rpartition(".")[0])
    except AttributeError:
        return False
    return True
