"""Nemotron-H's tensor-parallel plan, from shared pieces (titanlite/models/common/parallelize.py): each layer's one
sublayer split as the shared block plan splits it. Mamba-2 (mamba2_plan): the input projections column-wise, by heads
(z, x, dt) and by groups (B, C), so each rank holds whole groups and the heads that read them; the convolution's
weights and biases, A_log, D, dt_bias and the gated norm's weight sharded with them by rows (the norm's slices are
whole on a rank: mamba_norm_groups is a multiple of the degree); the output projection row-wise. Attention reads no
rotary tables; the MLP has no gate."""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from titanlite.models.common.interface import DecoderModule
from titanlite.models.common.mamba2 import CONVOLVED, CONVOLVED_BIASES
from titanlite.models.common.parallelize import MixerInput, block_plan
from titanlite.models.nemotron_h.args import NemotronHArgs

MAMBA_BY_HEAD = (*CONVOLVED, *CONVOLVED_BIASES, "A_log", "D", "dt_bias", "norm.weight")


def mamba2_plan() -> dict:
    """A Mamba-2 layer's mixer (titanlite/models/common/mamba2.py), under attention."""
    return {
        "attention_norm": SequenceParallel(),
        "attention": MixerInput(MAMBA_BY_HEAD),
        **{f"attention.{w}": ColwiseParallel() for w in ("wz", "wx", "wb", "wc", "wdt")},
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    }


def tp_plan(model: DecoderModule) -> dict:
    args = model.args
    assert isinstance(args, NemotronHArgs), type(args).__name__
    shared = block_plan(rotary=False, gated=False)
    attention = {k: v for k, v in shared.items() if k.startswith("attention")}
    attention["attention"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    mlp = {k: v for k, v in shared.items() if k.startswith(("ffn_norm", "feed_forward"))}
    plan: dict = {}
    for i in model.layers:
        kind = args.layer_types[int(i)]
        block = mamba2_plan() if kind == "mamba" else attention if kind == "full_attention" else mlp
        plan |= {f"layers.{i}.{name}": style for name, style in block.items()}
    return plan
