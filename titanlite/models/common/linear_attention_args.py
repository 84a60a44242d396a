"""The linear-attention layers' arguments, torch-free: the two layer kinds of a hybrid of linear and full attention and
their pattern (the Qwen hybrids, OLMo Hybrid, Kimi Linear), and the shared decoder's arguments with Gated DeltaNet
layers (GatedDeltaNetArgs, which the Qwen hybrids' and OLMo Hybrid's extend): the linear layers' heads, widths and
convolution, their checks, and what a tensor-parallel degree must divide. titanlite/models/common/gated_delta_net.py
builds the layers (gated_delta_net_of), kimi_delta.py Kimi Linear's, whose heads are shaped otherwise."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from titanlite.base.hf_config import COUNT, FieldTypes
from titanlite.models.common.decoder_args import DecoderArgs, tp_split_sizes

LAYER_KINDS = ("linear_attention", "full_attention")
# The config.json fields of GatedDeltaNetArgs' linear layers (the Qwen hybrids' and OLMo Hybrid's names) and their
# JSON types (check_types' table, titanlite/base/hf_config.py).
GATED_DELTA_NET_FIELDS: FieldTypes = {
    "linear_num_key_heads": (COUNT, False),
    "linear_num_value_heads": (COUNT, False),
    "linear_key_head_dim": (COUNT, False),
    "linear_value_head_dim": (COUNT, False),
    "linear_conv_kernel_dim": (COUNT, False),
}


def hybrid_layers(n_layers: int, interval: int = 4, last_full: bool = False) -> tuple[str, ...]:
    """Every `interval`-th layer full attention, the others linear (config.json's full_attention_interval, 4: three
    linear layers before each full-attention one); with `last_full` the last layer full attention too."""
    return tuple(
        "full_attention" if (i + 1) % interval == 0 or (last_full and i == n_layers - 1) else "linear_attention"
        for i in range(n_layers)
    )


def full_interval(layer_types: tuple[str, ...], otherwise: int) -> int:
    """The interval of a hybrid_layers pattern: the first full-attention layer's index + 1 (`otherwise` where there is
    none)."""
    return layer_types.index("full_attention") + 1 if "full_attention" in layer_types else otherwise


@dataclass
class GatedDeltaNetArgs(DecoderArgs):
    """The shared decoder with Gated DeltaNet layers (titanlite/models/common/gated_delta_net.py) beside full-attention
    ones, per `layer_types`: `linear_key_heads` key heads of `linear_key_dim` and `linear_value_heads` value heads of
    `linear_value_dim`, a convolution over `conv_size` tokens. The defaults are Qwen3.5's; a family's subclass gives
    its own and adds what differs."""

    layer_kinds: ClassVar[tuple[str, ...]] = LAYER_KINDS
    linear_key_heads: int = 16
    """The linear layers' query and key heads (linear_num_key_heads)."""
    linear_value_heads: int = 32
    """The linear layers' value heads (linear_num_value_heads), a multiple of linear_key_heads: value head h reads key
    head h // (linear_value_heads / linear_key_heads)."""
    linear_key_dim: int = 128
    """Each query and key head's width (linear_key_head_dim)."""
    linear_value_dim: int = 128
    """Each value head's width (linear_value_head_dim)."""
    conv_size: int = 4
    """Width of the linear layers' causal convolution (linear_conv_kernel_dim)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        if self.linear_value_heads % self.linear_key_heads:
            raise ValueError(
                f"{name}.linear_value_heads={self.linear_value_heads} must be a multiple of "
                f"linear_key_heads={self.linear_key_heads}"
            )
        if self.conv_size < 1:
            raise ValueError(f"{name}.conv_size={self.conv_size}; it must be at least 1")


def split_sizes(args: GatedDeltaNetArgs) -> dict[str, int]:
    """What a tensor-parallel degree must divide: the attention's heads, the MLP's width, the vocabulary, and the
    linear layers' key and value heads (each rank holds whole heads of both)."""
    return tp_split_sizes(args) | {
        "linear_key_heads": args.linear_key_heads,
        "linear_value_heads": args.linear_value_heads,
    }
