"""Activation checkpointing per transformer block: keep less from forward and recompute it in backward.

'full' recomputes whole blocks; 'selective_layer' every N-th block; 'selective_op' keeps the matmul and
attention outputs (the expensive ops) and recomputes the cheap rest (norms, activations, adds).
"""

from __future__ import annotations

from functools import partial

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from titanlite.config import ActivationCheckpoint
from titanlite.models.common.interface import DecoderModule

# Outputs worth keeping: recomputing them costs as much as the forward itself.
SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def apply_ac(model: DecoderModule, cfg: ActivationCheckpoint) -> None:
    """Wrap the blocks of `model` (in place) as `cfg.mode` asks."""
    if cfg.mode == "none":
        return
    for i, (key, block) in enumerate(list(model.layers.items())):
        if cfg.mode == "selective_layer" and i % cfg.selective_ac_option:
            continue
        if cfg.mode == "selective_op":
            wrapped = checkpoint_wrapper(
                block, context_fn=partial(create_selective_checkpoint_contexts, _op_policy), preserve_rng_state=False
            )
        else:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)  # no dropout: no RNG to replay
        model.layers.register_module(key, wrapped)


def _op_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE
