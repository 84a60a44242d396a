"""Data parallelism: FSDP2 `fully_shard` (ZeRO-2/ZeRO-3, HSDP on a 2-D mesh) and DDP over a mesh dimension."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard
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
    experts: ExpertSharding | None = None,
) -> None:
    """Shard each transformer block, then the embedding and output groups, then the root.

    reshard_after_forward=True frees gathered parameters after each block's forward (ZeRO-3);
    False keeps them until backward (ZeRO-2). A 2-D dp_mesh (replicate x shard) gives HSDP.
    cpu_offload keeps the shards (and so the optimizer's state) in pinned host memory.
    loss_reads_head: the loss reads the output weight after the model's forward (the chunked loss).
    experts: the expert-parallel experts, sharded first over their own mesh (shard_experts).
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    shard: dict[str, Any] = dict(mesh=dp_mesh, mp_policy=mp)
    if cpu_offload:
        shard["offload_policy"] = CPUOffloadPolicy()
    if experts is not None:
        shard_experts(experts, reshard_after_forward, **(shard | {"mesh": experts.mesh}))
    for end in (model.tok_embeddings, model.output):
        if end is not None:  # before fully_shard, so that it runs before FSDP's own post-forward hook
            end.register_forward_hook(own_output)
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


def own_output(module: nn.Module, args: Any, output: Any) -> Any:
    """A forward hook on the model's ends: their output as a tensor of its own where it is a view. FSDP registers a
    unit's pre-backward hook (which gathers its parameters again for backward) on its output, and an in-place op on
    a view would drop it, so FSDP2 warns of any view ("returned a view tensor"). Under tensor parallelism the
    embedding's output is one (DTensor.to_local() returns the local shard as a view), and so are the gathered
    logits without loss parallelism: a copy of [batch, seq / tp, dim] once a forward, or of the logits, whose
    gathered original is freed at once (the cross-entropy then holds two logits-sized tensors anyway)."""
    return output.clone() if isinstance(output, torch.Tensor) and output._base is not None else output


@dataclass
class ExpertSharding:
    """Expert-parallel experts (DTensors sharded over "ep", titanlite/parallel/expert_parallel.py) and how FSDP
    shards them further: over `mesh` (dp_shard / ep ranks, with dp_replicate for HSDP), their gradients divided by
    `divide_factor`, the whole data-parallel size (each expert's gradient already sums the tokens of its ep
    ranks, which FSDP's own mean over `mesh` would leave counted ep times)."""

    modules: Sequence[nn.Module]
    mesh: DeviceMesh
    divide_factor: int
    local_experts: int  # experts per ep rank


def shard_experts(experts: ExpertSharding, reshard_after_forward: bool, **shard: Any) -> None:
    """One FSDP unit per block's experts, on dim 0 (their local experts) or, with fewer local experts than
    shards, dim 1, so no shard is empty."""
    shards = experts.mesh.shape[-1]  # FSDP's shards (the last dimension; a first one is HSDP's replicas)
    placement = Shard(0) if experts.local_experts >= shards else Shard(1)
    for module in experts.modules:
        fully_shard(
            module, reshard_after_forward=reshard_after_forward, shard_placement_fn=lambda _: placement, **shard
        )
        unit = cast(FSDPModule, module)
        unit.set_gradient_divide_factor(experts.divide_factor)
        # gloo has no pre-multiplied sum: divide after a plain one. Not with one shard, where FSDP divides as it
        # copies (torch 2.13 would then divide again; the HSDP all-reduce sums either way).
        if experts.mesh.device_type != "cuda" and shards > 1:
            unit.set_force_sum_reduction_for_comms(True)


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """Replicate the model over dp_mesh; gradients are all-reduced (averaged) in buckets during backward."""
    device_ids = [torch.cuda.current_device()] if dp_mesh.device_type == "cuda" else None
    return DistributedDataParallel(model, process_group=dp_mesh.get_group(), device_ids=device_ids)
