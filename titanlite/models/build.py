"""Building the model a config describes (a named flavor, or a Hugging Face folder's shape) from its family's
spec. Builders construct on the current default device, so the trainer can build under torch.device("meta")."""

from __future__ import annotations

import dataclasses

from titanlite.base.devices import device_type
from titanlite.base.errors import ConfigError
from titanlite.models.common.attention import CoreAttention, build_core
from titanlite.models.common.gated_delta_net import DeltaRule, resolve_backend
from titanlite.models.common.interface import DecoderModule
from titanlite.models.common.mamba2 import StateScan, fla_scan_unavailable
from titanlite.models.common.mamba2_args import Mamba2Args
from titanlite.models.common.moe.args import MoEArgs
from titanlite.models.common.moe.layer import GroupedExperts
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


def configured_args(model_cfg, vocab_size: int, seq_len: int, moe=None, training=None):
    """The [model] section's model for a tokenizer of vocab_size ids and training.seq_len: a named flavor,
    or with flavor "hf" the shape of the Hugging Face folder model.hf_assets_path, vocabulary unpadded; with
    the [moe] section's load balancing (with_moe_settings) when `moe` is given, and [training]'s indexer settings
    (with_indexer_training) when `training` is."""
    m = model_cfg
    if m.flavor != "hf":
        args = model_args(m.name, m.flavor, vocab_size, seq_len, m.n_layers)
    else:
        args = folder_args(m.hf_assets_path, seq_len)
        if vocab_size > args.vocab_size:
            raise ConfigError(
                f"model.tokenizer={m.tokenizer!r} has {vocab_size} ids but {m.hf_assets_path} embeds "
                f"{args.vocab_size}; use the folder's own tokenizer (leave model.tokenizer out)"
            )
    args = with_mtp_layers(args, getattr(m, "mtp_layers", -1), m.hf_assets_path if m.flavor == "hf" else "")
    args = args if training is None else with_indexer_training(args, training)
    return args if moe is None else with_moe_settings(args, moe)


def with_indexer_training(args, training):
    """`args` with [training]'s indexer settings (indexer_loss_coefficient, indexer_dense_warmup) in its indexer, where
    it has one (the config's rules refuse them set for a model without)."""
    if hasattr(args, "indexer_loss_coefficient"):  # DeepSeek-V4's indexers over compressed blocks
        if training.indexer_dense_warmup:
            raise ConfigError(
                f"training.indexer_dense_warmup is not built for model {spec_of(args).name}, whose indexers pick "
                "compressed blocks (the warm-up is DeepSeek-V3.2's); leave it false"
            )
        return dataclasses.replace(args, indexer_loss_coefficient=training.indexer_loss_coefficient)
    indexer = getattr(args, "indexer", None)
    if indexer is None:
        return args
    settings = {"loss_coefficient": training.indexer_loss_coefficient, "dense_warmup": training.indexer_dense_warmup}
    return dataclasses.replace(args, indexer=dataclasses.replace(indexer, **settings))


def with_mtp_layers(args, mtp_layers: int, folder: str = ""):
    """`args` with model.mtp_layers' multi-token prediction depths (-1: the flavor's or the folder's own); a
    ConfigError for depths on a family whose Hugging Face config cannot say them (its arguments have no mtp_layers),
    and for a count other than a folder's own or 0 (`folder`: the model's Hugging Face folder, if any)."""
    if mtp_layers == -1:
        return args
    if not any(f.name == "mtp_layers" for f in dataclasses.fields(args)):
        if mtp_layers == 0:
            return args
        raise ConfigError(
            f"model.mtp_layers={mtp_layers}: model {spec_of(args).name} has no multi-token prediction its Hugging "
            "Face config.json can express (DeepSeek-V3's and GLM-4.5's num_nextn_predict_layers can); set "
            "model.mtp_layers = 0 or leave it out"
        )
    if folder and mtp_layers not in (0, args.mtp_layers):
        raise ConfigError(
            f"model.mtp_layers={mtp_layers}, but {folder} holds {args.mtp_layers} multi-token prediction layers "
            f"(num_nextn_predict_layers); use {args.mtp_layers} (the folder's), 0 (none), or leave it out"
        )
    try:
        return dataclasses.replace(args, mtp_layers=mtp_layers)
    except ValueError as e:  # a count the family's arguments refuse (Qwen's: 0 or 1)
        raise ConfigError(
            f"model.mtp_layers={mtp_layers} does not fit model {spec_of(args).name}: {e}; set one it takes, or leave "
            "model.mtp_layers out"
        ) from None


def with_moe_settings(args, moe):
    """`args` with the [moe] keys that are set (balance not "", coefficients not -1) in its MoEArgs. A key set for a
    model without mixture-of-experts blocks, or one that the balance ignores, is refused by the config's one rule
    for settings of a feature that is off (titanlite/config/rules.py, FEATURES), before this: a dense model takes
    none of them here (the command line replaced the config file's model of experts: they were that model's)."""
    set_keys = {key: value for key, value in dataclasses.asdict(moe).items() if value not in ("", -1, "auto")}
    if not set_keys or not isinstance(getattr(args, "moe", None), MoEArgs):
        return args
    set_keys.pop("experts_kernel", None)  # how the experts compute, not what (configured_model)
    return dataclasses.replace(args, moe=dataclasses.replace(args.moe, **set_keys))


def configured_model(model_cfg, vocab_size: int, seq_len: int, moe=None) -> DecoderModule:
    """Build configured_args's model on the current default device, parameters uninitialised, its attention cores
    of model.attn_backend's kind and its experts on moe.experts_kernel's path (how they compute, not what)."""
    model = model_from_args(configured_args(model_cfg, vocab_size, seq_len, moe))
    linear = linear_backend(model.args, model_cfg.linear_attn_backend, device_type())[0]
    return with_kernels(model, model_cfg.attn_backend, "" if moe is None else moe.experts_kernel, linear)


def linear_backend(args, choice: str, device: str, smoke: bool = True) -> tuple[str, str]:
    """model.linear_attn_backend for the model of `args` on `device` (resolve_backend): the backend and why the
    PyTorch path where it is that; a ConfigError for a choice that cannot run here, or that changes nothing (set
    explicitly for a model without linear-attention layers). `smoke`: run fla's kernels once on the device
    (resolve_backend; not in the launcher, which must not initialise CUDA before its workers fork)."""
    mamba = isinstance(args, Mamba2Args)
    if "linear_attention" not in getattr(args, "layer_types", ()) and not mamba:
        if choice != "auto":
            raise ConfigError(
                f"model.linear_attn_backend={choice!r} changes nothing: model {args.family} has no linear-attention "
                "or Mamba-2 layers; leave it out"
            )
        return "torch", ""
    try:
        backend, why = resolve_backend(choice, device, smoke)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    scan_why = fla_scan_unavailable(device, smoke) if mamba and backend == "fla" else None
    if scan_why is not None and choice == "fla":
        raise ConfigError(f"model.linear_attn_backend='fla' cannot run here: {scan_why}; use 'auto' or 'torch'")
    return ("torch", scan_why) if scan_why is not None else (backend, why)


def with_kernels(
    model: DecoderModule, attn_backend: str, experts_kernel: str, linear_backend: str = "torch"
) -> DecoderModule:
    """`model` with its attention cores of `attn_backend`'s kind (model.attn_backend), its experts looping over each
    expert where `experts_kernel` (moe.experts_kernel) says "loop", and its linear-attention layers' delta rule and
    Mamba-2 layers' scan on `linear_backend` ("torch" or "fla": model.linear_attn_backend resolved for the device): how
    it computes, not what."""
    if attn_backend != "sdpa":
        for module in list(model.modules()):
            core = getattr(module, "core", None)
            if isinstance(core, CoreAttention):
                module.core = build_core(attn_backend, **core.options())
    for module in model.modules():
        if isinstance(module, (DeltaRule, StateScan)):
            module.backend = linear_backend
    if experts_kernel == "loop":
        for module in model.modules():
            if isinstance(module, GroupedExperts):
                module.use_grouped_mm = False
    return model
