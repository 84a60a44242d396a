"""Multi-head latent attention's tensor-parallel plan (the latent decoder's: titanlite/models/common/latent/model.py;
DeepSeek-V3's): latent attention split by heads on every layer, the dense layers as Llama's, a mixture-of-experts block
whole on every tensor-parallel rank (titanlite/models/common/parallelize.py; with expert tensor parallelism its experts
split over them instead: titanlite/parallel/expert_tensor_parallel.py).

Attention takes the whole sequence as a plain tensor. The per-head projections are split: the query's (wq, or wq_b
after the low-rank bottleneck) and the latent's expansion wkv_b column-wise, each rank computing its heads; wo
row-wise, back to this rank's slice of the sequence. The latent projections (wq_a, wkv_a) and their norms are small
and shared by every head, so each rank runs them whole on the same tokens: their gradients, summed over the heads
of all ranks by the column-wise layers' input all-reduce, are the same on every rank, as the MoE block's are. The
one exception is the rotary key, which every head reads without a split layer in between: each rank's gradient of
it holds its own heads' part only, so RotaryKeyGradients sums it over the tensor-parallel ranks in backward."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from titanlite.models.common.interface import DecoderModule
from titanlite.models.common.latent.args import LatentArgs
from titanlite.models.common.parallelize import block_plan, moe_block_plan, sum_gradient


class RotaryKeyGradients(ParallelStyle):
    """On wkv_a: its output's last channels from `latent` on (the rotary key, shared by every head) pass through
    unchanged and get their gradient summed over the tensor-parallel ranks, each of which holds some heads."""

    def __init__(self, latent: int):
        super().__init__()
        self.latent = latent

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group, latent = device_mesh.get_group(), self.latent

        def hook(module: nn.Module, inputs, out: torch.Tensor) -> torch.Tensor:
            return torch.cat([out[..., :latent], sum_gradient(out[..., latent:], group)], dim=-1)

        module.register_forward_hook(hook)
        return module


class SumOverHeads(ParallelStyle):
    """On a sparse attention layer's HeadSums: its output, this rank's heads' attention weights summed, is summed over
    the tensor-parallel ranks (one all-reduce of [B, T, topk], no gradient: the indexer's target), so that every rank
    trains its whole indexer toward every head's attention."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()

        def hook(module: nn.Module, inputs, out: torch.Tensor) -> torch.Tensor:
            summed = out.detach().clone()
            dist.all_reduce(summed, group=group)
            return summed

        module.register_forward_hook(hook)
        return module


class SumKeyGradients(ParallelStyle):
    """On a sparse attention layer's SharedKeys: the latents its heads read as keys and values pass through unchanged,
    their gradient (this rank's heads' part) summed over the tensor-parallel ranks in backward."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()
        module.register_forward_hook(lambda module, inputs, out: sum_gradient(out, group))
        return module


def latent_attention_plan(q_lora_rank: int, kv_lora_rank: int, indexer: bool = False) -> dict:
    """One layer's latent attention split by heads; with an `indexer`, the indexer kept whole on every rank (its
    heads are few and narrow, and its input is the attention's, whole on each rank: splitting it would cost an
    all-reduce of [B, T, S] scores where keeping it costs one of [B, T, topk] weights, SumOverHeads)."""
    query = "attention.wq_b" if q_lora_rank else "attention.wq"
    sparse = {"attention.head_sums": SumOverHeads(), "attention.shared_keys": SumKeyGradients()} if indexer else {}
    return sparse | {
        # attention(x, cos, sin): gather x's sequence, as a plain tensor (the latent layers are not DTensors).
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None),
            desired_input_layouts=(Replicate(), None, None),
            use_local_output=True,
        ),
        query: ColwiseParallel(),
        "attention.wkv_a": RotaryKeyGradients(kv_lora_rank),
        "attention.wkv_b": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    }


def tp_plan(model: DecoderModule) -> dict:
    """Every layer's: latent attention (latent_attention_plan), and the dense feed-forward or, at args.moe's sparse
    layers, the MoE block."""
    args = model.args
    assert isinstance(args, LatentArgs), type(args).__name__
    llama = block_plan()
    plan: dict = {}
    for i in model.layers:
        block = {name: style for name, style in llama.items() if name.partition(".")[0] != "attention"}
        block |= latent_attention_plan(args.q_lora_rank, args.kv_lora_rank, args.indexer is not None)
        if args.moe is not None and args.moe.is_sparse(int(i)):
            block = {name: style for name, style in block.items() if name.partition(".")[0] != "feed_forward"}
            block["feed_forward"] = moe_block_plan()
        plan |= {f"layers.{i}.{name}": style for name, style in block.items()}
    return plan
