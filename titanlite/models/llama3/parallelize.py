"""The Llama decoder's tensor-parallel plan for its blocks (titanlite/parallel/tensor_parallel.py adds the
embedding, final norm and output ends and applies it)."""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from titanlite.models.common.interface import DecoderModule


def block_plan() -> dict:
    """One block: biases shard with their column-wise weights (and stay whole after the row-wise ones);
    post-norm blocks normalise the sequence-sharded outputs of the sublayers with the same norms."""
    return {
        "attention_norm": SequenceParallel(),
        # attention(x, cos, sin): gather x's sequence; the RoPE tables are plain replicated tensors.
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }


def per_head_norms() -> dict:
    """Per-head Q/K norms see this rank's heads: their weight is replicated and its gradient, a partial sum per
    rank, is summed over TP (SequenceParallel over the heads' dimension)."""
    return {
        f"attention.{norm}": SequenceParallel(sequence_dim=2, use_local_output=True) for norm in ("q_norm", "k_norm")
    }


def tp_plan(model: DecoderModule) -> dict:
    block = (per_head_norms() if model.args.qk_norm == "head" else {}) | block_plan()
    return {f"layers.{i}.{name}": style for i in model.layers for name, style in block.items()}
