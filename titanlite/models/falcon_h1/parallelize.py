"""Falcon-H1's tensor-parallel plan, from shared pieces (titanlite/models/common/parallelize.py): each layer's
attention and SwiGLU MLP as the shared block plan splits them, and its Mamba-2 mixer as mamba2_plan splits one, by heads
and groups, under the block's name for it, `mamba` (without the gated norm's weight where the mixer has no norm)."""

from __future__ import annotations

from titanlite.models.common.interface import DecoderModule
from titanlite.models.common.parallelize import MAMBA_BY_HEAD, MixerInput, block_plan, mamba2_plan
from titanlite.models.falcon_h1.args import FalconH1Args


def mamba_plan(args: FalconH1Args) -> dict:
    """mamba2_plan's mixer entries under `mamba` (the block's norm is the attention's, in block_plan)."""
    plan = {
        "mamba" + name[len("attention") :]: style for name, style in mamba2_plan().items() if name != "attention_norm"
    }
    if not args.mamba_gated_norm:
        plan["mamba"] = MixerInput(tuple(name for name in MAMBA_BY_HEAD if name != "norm.weight"))
    return plan


def tp_plan(model: DecoderModule) -> dict:
    args = model.args
    assert isinstance(args, FalconH1Args), type(args).__name__
    block = block_plan(rotary=True, gated=True) | mamba_plan(args)
    return {f"layers.{i}.{name}": style for i in model.layers for name, style in block.items()}
