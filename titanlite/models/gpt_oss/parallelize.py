"""gpt-oss's tensor-parallel plan: the MoE decoder's (the Llama decoder's attention, each MoE block whole on every
rank), with the attention's sink logits sharded by head as its query projection is: a rank's core sees its own
heads' sinks, and each sink's gradient stays with the rank that holds it."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import PrepareModuleInput

from titanlite.models.common.interface import DecoderModule
from titanlite.models.common.parallelize import moe_tp_plan as moe_decoder_plan


class AttentionWithSinks(PrepareModuleInput):
    """The Llama plan's attention input (the sequence gathered; the RoPE tables as they are), and `sinks` [n_heads]
    a DTensor sharded on its heads."""

    def __init__(self) -> None:
        super().__init__(input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        sinks = module.get_parameter("sinks")
        module.register_parameter("sinks", nn.Parameter(distribute_tensor(sinks, device_mesh, [Shard(0)])))
        return super()._apply(module, device_mesh)


def tp_plan(model: DecoderModule) -> dict:
    plan = moe_decoder_plan(model)
    for i in model.layers:
        plan[f"layers.{i}.attention"] = AttentionWithSinks()
    return plan
