"""Data parallelism: FSDP2 `fully_shard` (ZeRO-2/ZeRO-3, HSDP on a 2-D mesh) and DDP over a mesh dimension."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from titanlite.models.common.interface import DecoderModule


def apply_fsdp(
    model: DecoderModule,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool,
    cpu_offload: bool = False,
    loss_reads_head: bool = False,
) -> None:
    """Shard each transformer block, then the embedding and output groups, then the root.

    reshard_after_forward=True frees gathered parameters after each block's forward (ZeRO-3);
    False keeps them until backward (ZeRO-2). A 2-D dp_mesh (replicate x shard) gives HSDP.
    cpu_offload keeps the shards (and so the optimizer's state) in pinned host memory.
    loss_reads_head: the loss reads the output weight after the model's forward (the chunked loss).
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    shard: dict[str, Any] = dict(mesh=dp_mesh, mp_policy=mp)
    if cpu_offload:
        shard["offload_policy"] = CPUOffloadPolicy()
    for block in model.layers.values():
        fully_shard(block, reshard_after_forward=reshard_after_forward, **shard)
    # A tied embedding is one parameter used at both ends: it must live in one FSDP unit, and only
    # the root spans both uses, so tied weights stay with the root.
    tied = (
        model.output is not None
        and model.tok_embeddings is not None
        and model.output.weight is model.tok_embeddings.weight
    )
    if not tied:
        if model.tok_embeddings is not None:
            fully_shard(model.tok_embeddings, reshard_after_forward=reshard_after_forward, **shard)
        if model.output is not None:
            # The last unit's parameters are needed again right away by backward: never reshard them.
            head = [m for m in (model.norm, model.output) if m is not None]
            fully_shard(head, reshard_after_forward=False, **shard)
    # The chunked loss (titanlite/components/loss.py) reads the output weight after the model's forward: a tied
    # one, in the root, must still be gathered then.
    keep_root = tied and loss_reads_head
    fully_shard(model, reshard_after_forward=reshard_after_forward and not keep_root, **shard)


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """Replicate the model over dp_mesh; gradients are all-reduced (averaged) in buckets during backward."""
    device_ids = [torch.cuda.current_device()] if dp_mesh.device_type == "cuda" else None
    return DistributedDataParallel(model, process_group=dp_mesh.get_group(), device_ids=device_ids)
