"""DeepSeek-V4's tensor-parallel plan. Between the blocks the residual streams [B, T, n, D] are sharded by sequence,
as the shared plans shard the one stream: the hyper-connections, the hyper-head and the norms run on a rank's slice
of the tokens with their parameters replicated (DTensors, whose gradients are summed over the ranks).

Attention takes the whole sequence and is split by heads: the query's expansion wq_b column-wise, the sink logits
and the output's grouped projection wo_a by head (each rank holds whole groups of heads), wo_b row-wise back to this
rank's slice. The low-rank query projection, the one key/value head, the compressors and the indexer are small and
run whole on every rank: the query's gradient is summed by wq_b's input, the keys' (which every head reads, with no
split layer between) by SumKeyGradients on the attention's shared keys, and the indexer, whose input is detached,
learns from every head's weights over its picks (SumOverHeads on the head sums). A mixture-of-experts block runs
whole on every rank, as the shared plan's (titanlite/models/common/parallelize.py moe_block_plan)."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from titanlite.models.common.interface import DecoderModule
from titanlite.models.common.latent.parallelize import SumKeyGradients, SumOverHeads
from titanlite.models.common.parallelize import moe_block_plan


class OnSequenceShard(SequenceParallel):
    """SequenceParallel for a module of several outputs (a hyper-connection's read, post and comb): each output back
    to a plain tensor of this rank's slice of the sequence."""

    def __init__(self) -> None:
        super().__init__(sequence_dim=1, use_local_output=True)

    @staticmethod
    def _prepare_output_fn(use_local_output, mod, outputs, device_mesh):
        if isinstance(outputs, tuple):
            return tuple(out.to_local() for out in outputs)
        return outputs.to_local()


class AttentionInput(PrepareModuleInput):
    """The attention's input x gathered over the sequence, as a plain tensor (the rotary tables as they are), and its
    `sinks` [n_heads] a DTensor sharded by head, as wq_b's output is."""

    def __init__(self) -> None:
        super().__init__(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None), use_local_output=True
        )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        sinks = module.get_parameter("sinks")
        module.register_parameter("sinks", nn.Parameter(distribute_tensor(sinks, device_mesh, [Shard(0)])))
        return super()._apply(module, device_mesh)


class ByRows(ParallelStyle):
    """A module's `weight` sharded by rows (a grouped projection's whole groups: GroupedLinear maps its shard's)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        weight = module.get_parameter("weight")
        module.register_parameter("weight", nn.Parameter(distribute_tensor(weight, device_mesh, [Shard(0)])))
        return module


def tp_plan(model: DecoderModule) -> dict:
    """Every layer's hyper-connections, norms, attention (split by heads) and mixture of experts (whole), the
    hyper-head before the final norm and each multi-token prediction depth's (its norms and projections: the shared
    ends_plan)."""
    plan: dict[str, ParallelStyle] = {"streams": OnSequenceShard()}
    for key in getattr(model, "mtp", None) or {}:  # a multi-token prediction depth's own hyper-head
        plan[f"mtp.{key}.streams"] = OnSequenceShard()
    for i in model.layers:
        layer = {
            "attention_hc": OnSequenceShard(),
            "attention_norm": SequenceParallel(),
            "attention": AttentionInput(),
            "attention.wq_b": ColwiseParallel(),
            "attention.wo_a": ByRows(),
            "attention.wo_b": RowwiseParallel(output_layouts=Shard(1)),
            "attention.shared_keys": SumKeyGradients(),
            "attention.head_sums": SumOverHeads(),
            "ffn_hc": OnSequenceShard(),
            "ffn_norm": SequenceParallel(),
            "feed_forward": moe_block_plan(),
        }
        plan |= {f"layers.{i}.{name}": style for name, style in layer.items()}
    return plan
