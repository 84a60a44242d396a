"""A pool body for test_hf_layouts.py (tests/pool.py): import a Hugging Face folder into the configured layout
(model.flavor = "hf") through titanlite's own build and load path, and give back the full logits of a batch.

Every rank gets the same tokens; rank 0 returns the whole [batch, seq, vocab] logits (gathered from
tensor-parallel shards), the others None.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from titanlite.builder.model import build_model
from titanlite.builder.plan import plan_run
from titanlite.builder.runtime import init_distributed
from titanlite.components.checkpoint import initial_weights_path, load_weights
from titanlite.config import parse_config


def layout_logits_on_rank(tokens: torch.Tensor, argv: list[str]) -> torch.Tensor | None:
    cfg = parse_config(argv)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    plan = plan_run(cfg, world_size)
    device = init_distributed(world_size, cfg.comm.init_timeout_seconds, one_rank_mesh=plan.dims.fsdp_single_rank)
    mesh = plan.dims.build_mesh(device.type)
    _, parts = build_model(cfg, plan, mesh, device)
    load_weights(parts, Path(initial_weights_path(cfg)))
    (model,) = parts
    model.eval()
    with torch.no_grad():
        logits = model(tokens.to(device))
    if isinstance(logits, DTensor):  # vocabulary-parallel output under TP
        logits = logits.full_tensor()
    return logits.cpu() if int(os.environ.get("RANK", 0)) == 0 else None
