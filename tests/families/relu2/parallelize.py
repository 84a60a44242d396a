"""relu2's tensor-parallel plan for its blocks, from PyTorch's parallel styles (the ends are titanlite's)."""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel


def tp_plan(model) -> dict:
    """Each layer's styles for the modules it has: an attention layer's wq, wk, wv, wo, a shift layer's wa, wb, wo."""
    # use_local_output: the mixers see plain tensors (the shift layer masks its input by document)
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True)
    block = {
        "attention_norm": SequenceParallel(),
        "attention": gather,
        **{f"attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")},
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        **{f"attention.{w}": ColwiseParallel() for w in ("wa", "wb")},  # the shift layers' mixer
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
    return {
        f"layers.{i}.{name}": style
        for i, layer in model.layers.items()
        for name, style in block.items()
        if not name.startswith("attention.") or hasattr(layer.attention, name.split(".")[1])
    }
