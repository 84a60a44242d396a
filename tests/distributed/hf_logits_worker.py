"""torchrun worker of test_hf_layouts.py: import a Hugging Face folder into the configured layout (model.flavor
= "hf") through titanlite's own build and load path, and write the full logits of a fixed batch.

usage: torchrun ... tests/distributed/hf_logits_worker.py OUT.pt TOKENS.pt [--section.key VALUE ...]
Every rank gets the same tokens; rank 0 saves the whole [batch, seq, vocab] logits (gathered from
tensor-parallel shards) to OUT.pt.
"""

import os
import sys

import torch
from torch.distributed.tensor import DTensor


def main(out: str, tokens_file: str, argv: list[str]) -> None:
    from pathlib import Path

    from titanlite.builder.model import build_model
    from titanlite.builder.plan import plan_run
    from titanlite.builder.runtime import init_distributed
    from titanlite.commands.worker import shutdown
    from titanlite.components.checkpoint import initial_weights_path, load_weights
    from titanlite.config import parse_config
    from titanlite.data.tokenizer import build_tokenizer

    cfg = parse_config(argv)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    plan = plan_run(cfg, world_size)
    device = init_distributed(world_size, cfg.comm.init_timeout_seconds, one_rank_mesh=plan.dims.fsdp_single_rank)
    mesh = plan.dims.build_mesh(device.type)
    vocab_size = build_tokenizer(cfg.model.tokenizer, cfg.model.hf_assets_path).vocab_size
    _, parts = build_model(cfg, vocab_size, plan, mesh, device)
    load_weights(parts, Path(initial_weights_path(cfg)))
    (model,) = parts
    model.eval()
    tokens = torch.load(tokens_file).to(device)
    with torch.no_grad():
        logits = model(tokens)
    if isinstance(logits, DTensor):  # vocabulary-parallel output under TP
        logits = logits.full_tensor()
    if int(os.environ.get("RANK", 0)) == 0:
        torch.save(logits.cpu(), out)
    shutdown(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
