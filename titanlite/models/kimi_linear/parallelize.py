"""Kimi Linear's tensor-parallel plan: both mixers split by heads, the dense layers as Llama's, a mixture-of-experts
block whole on every tensor-parallel rank (titanlite/models/common/parallelize.py).

Each mixer takes the whole sequence as a plain tensor. KDA: the per-head projections (wq, wk, wv, the gates' second
halves wf_b and wg_b, wb) column-wise and wo row-wise; the convolutions' weights, A_log and dt_bias sharded by rows
(their heads); the gates' low-rank first halves (wf_a, wg_a) whole on every rank, their gradients complete because the
column-wise layers after them sum their inputs' gradients; the output norm's weight, shared by the heads, replicated
with its gradient summed over the ranks (per-head norms). Latent attention as DeepSeek-V3's: the query and wkv_b
column-wise, wo row-wise, the latent projections whole, and the key channels every head shares (k_rot, not rotated
here) get their gradient summed over the ranks in backward."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from titanlite.models.common.interface import DecoderModule
from titanlite.models.common.parallelize import LINEAR_BY_HEAD, MixerInput, block_plan, moe_block_plan
from titanlite.models.kimi_linear.args import KimiLinearArgs


class SharedKeyGradients(ParallelStyle):
    """On wkv_a: its output's channels from `latent` on (the key channels every head shares) pass through unchanged,
    their gradient summed over the tensor-parallel ranks (each holds some heads' part of it): a replicated DTensor
    whose local gradient is declared partial."""

    def __init__(self, latent: int):
        super().__init__()
        self.latent = latent

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        latent = self.latent

        def hook(module: nn.Module, inputs, out: torch.Tensor) -> torch.Tensor:
            shared = DTensor.from_local(out[..., latent:], device_mesh, [Replicate()], run_check=False)
            return torch.cat([out[..., :latent], shared.to_local(grad_placements=[Partial()])], dim=-1)

        module.register_forward_hook(hook)
        return module


def kda_plan() -> dict:
    return {
        "attention": MixerInput(LINEAR_BY_HEAD),
        **{f"attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv", "wf_b", "wb", "wg_b")},
        "attention.norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    }


def latent_plan(q_lora_rank: int, kv_lora_rank: int) -> dict:
    return {
        "attention": MixerInput(),
        "attention.wq_b" if q_lora_rank else "attention.wq": ColwiseParallel(),
        "attention.wkv_a": SharedKeyGradients(kv_lora_rank),
        "attention.wkv_b": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    }


def tp_plan(model: DecoderModule) -> dict:
    args = model.args
    assert isinstance(args, KimiLinearArgs), type(args).__name__
    llama = {name: style for name, style in block_plan().items() if name.partition(".")[0] != "attention"}
    plan: dict = {}
    for i in model.layers:
        block = dict(llama)
        if args.layer_types[int(i)] == "linear_attention":
            block |= kda_plan()
        else:
            block |= latent_plan(args.q_lora_rank, args.kv_lora_rank)
        if args.moe is not None and args.moe.is_sparse(int(i)):
            block = {name: style for name, style in block.items() if name.partition(".")[0] != "feed_forward"}
            block["feed_forward"] = moe_block_plan()
        plan |= {f"layers.{i}.{name}": style for name, style in block.items()}
    return plan
