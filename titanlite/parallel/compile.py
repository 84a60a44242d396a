"""torch.compile per transformer block (one graph per block, reused by every block of the same shape)."""

from __future__ import annotations

import torch

from titanlite.components.loss import cross_entropy
from titanlite.config import Compile
from titanlite.models.common.interface import DecoderModule
from titanlite.models.common.moe.layer import GroupedExperts


def apply_compile(model: DecoderModule, cfg: Compile) -> None:
    """Compile each block in place; applied after activation checkpointing and before FSDP, so the
    compiled region is the block's own compute and FSDP's communication stays outside it."""
    if not (cfg.enable and "model" in cfg.components):
        return
    for key, block in list(model.layers.items()):
        # A mixture-of-experts block reads its routed counts on the host (the expert loop's splits, expert
        # parallelism's all-to-all sizes) and holds the experts' own FSDP unit: its graph breaks there.
        whole = not any(isinstance(m, GroupedExperts) for m in block.modules())
        # torch.compile of a module is a module (OptimizedModule); its stub says only Callable.
        model.layers.register_module(key, torch.compile(block, fullgraph=whole, **compile_options(cfg)))  # type: ignore[arg-type]


def compiled_loss(loss_fn, cfg: Compile, loss_parallel: bool):
    """The plain loss, compiled when compile.components names it (fusing the float32 cast, log-softmax
    and gather keeps the full-vocabulary intermediates from being written out). The chunked loss stays
    eager: its chunks already keep those intermediates small.

    Not under loss parallelism: in torch 2.13 a compiled cross-entropy on vocabulary-sharded logits
    does not go through loss_parallel's sharded implementation and returns a wrong (doubled) loss."""
    if cfg.enable and "loss" in cfg.components and not loss_parallel and loss_fn is cross_entropy:
        return torch.compile(loss_fn, **compile_options(cfg))
    return loss_fn


def compile_options(cfg: Compile) -> dict:
    """torch.compile's backend and, for inductor, its mode (compile.mode; checked in config loading)."""
    if cfg.mode == "default":
        return {"backend": cfg.backend}
    return {"backend": cfg.backend, "mode": cfg.mode}
