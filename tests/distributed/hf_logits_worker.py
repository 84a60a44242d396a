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


def layout_logits_and_reads_on_rank(tokens: torch.Tensor, argv: list[str]) -> tuple[torch.Tensor | None, list]:
    """layout_logits_on_rank's logits, and what this rank read of the folder: (tensor name, rows or None for all)
    for each read, in order."""
    from titanlite.components.hf_weights import WeightReader

    reads: list[tuple[str, tuple[int, int] | None]] = []
    get = WeightReader.get

    def recording(self, name, rows=None):
        reads.append((name, None if rows is None else (rows.start, rows.stop)))
        return get(self, name, rows)

    WeightReader.get = recording  # type: ignore[method-assign]  # this pool body's own process, put back below
    try:
        return layout_logits_on_rank(tokens, argv), reads
    finally:
        WeightReader.get = get  # type: ignore[method-assign]
