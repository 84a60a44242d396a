"""Activation checkpointing per transformer block: keep less from forward and recompute it in backward.

'full' recomputes whole blocks; 'selective_layer' every N-th block; 'selective_op' keeps the matmul and
attention outputs (the expensive ops) and recomputes the cheap rest (norms, activations, adds).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from titanlite.config import ActivationCheckpoint
from titanlite.models.common.auxiliary import recomputation
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


def apply_ac(model: DecoderModule, cfg: ActivationCheckpoint, compiled: bool = False) -> None:
    """Wrap the blocks of `model` (in place) as `cfg.mode` asks. Eager (not `compiled`), each recompute runs inside
    the auxiliary losses' `recomputation()`, so a term a block adds is recorded once per trained forward; compiled, the
    recompute is the compiled backward's, which runs no Python, and torch.compile takes no other contexts than
    selective checkpointing's."""
    if cfg.mode == "none":
        return
    for i, (key, block) in enumerate(list(model.layers.items())):
        if cfg.mode == "selective_layer" and i % cfg.selective_ac_option:
            continue
        if cfg.mode == "selective_op":
            context = partial(create_selective_checkpoint_contexts, _op_policy)
            wrapped = checkpoint_wrapper(
                block, context_fn=context if compiled else partial(_recording_once, context), preserve_rng_state=False
            )
        elif compiled:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)  # no dropout: no RNG to replay
        else:
            wrapped = checkpoint_wrapper(block, context_fn=_recording_once, preserve_rng_state=False)
        model.layers.register_module(key, wrapped)


def _recording_once(contexts=None) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """The checkpoint's forward and recompute contexts (`contexts()`'s, where given, e.g. selective checkpointing's),
    the recompute also inside `recomputation()`."""
    forward, recompute = contexts() if contexts is not None else (contextlib.nullcontext(), contextlib.nullcontext())
    return forward, _both(recompute, recomputation())


@contextlib.contextmanager
def _both(first: contextlib.AbstractContextManager, second: contextlib.AbstractContextManager) -> Iterator[None]:
    with first, second:
        yield


def _op_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE
