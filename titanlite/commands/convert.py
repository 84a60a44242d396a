"""Weights in and out of a run folder, in one process: `titanlite seed-checkpoint` writes step-0/ (the initial
weights, model only), `titanlite convert to-hf` exports a checkpoint as a Hugging Face folder."""

from __future__ import annotations

from pathlib import Path

import torch

from titanlite.base.command_line import take_options
from titanlite.base.errors import ConfigError
from titanlite.builder.model import plain_model
from titanlite.builder.plan import plan_model
from titanlite.components.checkpoint import (
    initial_weights_path,
    load_model_only,
    parse_run_config,
    pick_checkpoint,
    recorded_evaluation,
    save_model_only,
)
from titanlite.components.hf_weights import check_export_folder, export_loads, is_hf_folder, save_hf
from titanlite.config import parse_config
from titanlite.models.common.init import init_weights


def seed_checkpoint(argv: list[str]) -> int:
    cfg = parse_config(argv)
    model = plain_model(cfg, plan_model(cfg))
    init_weights(model, cfg.training.seed)
    path = save_model_only(Path(cfg.job.dump_folder) / cfg.job.name, 0, model.state_dict())
    print(f"titanlite: wrote the seed checkpoint {path}; runs with checkpoint.enable load it on any layout")
    return 0


def carried_folder(cfg) -> str | None:
    """The Hugging Face folder the run started from (its tensors the model does not train, and its layout, go into
    the export), or None for a run from fresh weights or a DCP checkpoint."""
    start = initial_weights_path(cfg)
    if start and (is_hf_folder(start) or cfg.model.flavor == "hf"):
        return start  # save_hf refuses a model.hf_assets_path that is gone
    if start and not Path(start).exists():
        print(
            f"titanlite: note: checkpoint.initial_load_path={start}, where the run started, is gone: if it was a "
            "Hugging Face folder holding more than the model (a vision tower, mtp layers), those tensors are not in "
            "the export"
        )
    return None


def convert(argv: list[str]) -> int:
    if not argv or argv[0] != "to-hf":
        raise ConfigError(
            "convert takes 'to-hf --output DIR'; to import a Hugging Face folder set checkpoint.initial_load_path"
        )
    opts, rest = take_options(argv[1:], {"output": ""}, "convert to-hf")
    output = opts["output"]
    if not output:
        raise ConfigError("convert to-hf needs --output DIR")
    check_export_folder(output)  # before the checkpoint is read: a folder holding another model is refused
    cfg = parse_run_config(rest)  # the model the checkpoint was trained as, without its flags repeated
    run_dir = Path(cfg.job.dump_folder) / cfg.job.name
    path = pick_checkpoint(run_dir, cfg.checkpoint.load_step)
    if path is None:
        raise ConfigError(f"no complete checkpoint in {run_dir}; train with checkpoint.enable first")
    planned = plan_model(cfg)
    model = plain_model(cfg, planned)
    load_model_only(path, model)
    save_hf(
        output,
        model.args,
        model.state_dict(),
        dtype=getattr(torch, cfg.checkpoint.export_dtype),
        tokenizer=planned.tokenizer,
        max_shard_bytes=int(cfg.checkpoint.export_max_shard_gb * 2**30),
        carry_from=carried_folder(cfg),
        quantized=cfg.checkpoint.export_quantized,
        evaluation=recorded_evaluation(path),  # what `titanlite eval` of the export reads, as of the run
    )
    what, loads = export_loads(output, cfg.checkpoint.export_dtype)  # an fp8 export needs more of transformers
    print(f"titanlite: exported {path} to {output} ({what}, tokenizer {cfg.model.tokenizer}); {loads}")
    return 0
