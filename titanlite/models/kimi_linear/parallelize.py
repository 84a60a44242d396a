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

from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
)

from titanlite.models.common.interface import DecoderModule
from titanlite.models.common.latent.parallelize import RotaryKeyGradients
from titanlite.models.common.parallelize import LINEAR_BY_HEAD, MixerInput, block_plan, moe_block_plan
from titanlite.models.kimi_linear.args import KimiLinearArgs


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
        "attention.wkv_a": RotaryKeyGradients(kv_lora_rank),  # the key channels every head shares
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
