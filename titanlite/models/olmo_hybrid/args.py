"""OLMo Hybrid's arguments, torch-free: the shared decoder's with Gated DeltaNet layers (GatedDeltaNetArgs,
titanlite/models/common/linear_attention_args.py: linear attention, pre-norm) beside OLMo 2's post-norm full attention
with whole-projection Q/K norms, the linear layers' doubled write strength, and whether the attention layers rotate at
all; the published size."""

from __future__ import annotations

from dataclasses import dataclass

from titanlite.models.common.decoder_args import DEBUG_SIZES
from titanlite.models.common.linear_attention_args import LAYER_KINDS, GatedDeltaNetArgs, hybrid_layers
from titanlite.models.spec import not_math


def olmo_layers(n_layers: int, interval: int = 4) -> tuple[str, ...]:
    """Every `interval`-th layer full attention, the others linear, and the last one full where that leaves none
    (transformers' OlmoHybridConfig default: three Gated DeltaNet layers before each attention layer)."""
    return hybrid_layers(n_layers, interval, last_full=n_layers < interval)


@dataclass
class OlmoHybridArgs(GatedDeltaNetArgs):
    """OLMo Hybrid's decoder (titanlite/models/olmo_hybrid/model.py). Attention layers (OLMo 2's): post-norm blocks,
    RMSNorms over each token's whole query and key projections, rotations by `rope_theta` where `rope`. Linear
    layers: pre-norm blocks around Gated DeltaNet (their shape: GatedDeltaNetArgs), the write strength doubled where
    `allow_neg_eigval`."""

    family: str = not_math("olmo_hybrid")
    qk_norm: str = "full"
    norm_position: str = "post"
    """The attention layers' placement; the linear layers' blocks are always pre-norm."""
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope: bool = True
    """Rotate the attention layers' queries and keys (RoPE); False: no positions but the causal order (NoPE, the
    published checkpoints: their config.json sets rope_theta null)."""
    linear_key_heads: int = 30
    linear_value_heads: int = 30
    linear_key_dim: int = 96
    linear_value_dim: int = 192
    allow_neg_eigval: bool = True
    """The write strength beta = 2 sigmoid(b), in (0, 2), so the state update's eigenvalues may turn negative
    (linear_allow_neg_eigval); False: sigmoid(b)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.layer_types:
            self.layer_types = olmo_layers(self.n_layers)
        if self.qk_norm != "full" or self.norm_position != "post" or self.nope_layers or self.sliding_window:
            raise ValueError(
                "OlmoHybridArgs: qk_norm is 'full', norm_position 'post', no nope_layers or sliding window"
            )
        if self.rotary_dim != self.head_dim:
            raise ValueError(f"OlmoHybridArgs.rotary_dim={self.rotary_dim}: OLMo Hybrid rotates whole heads")
        if set(self.layer_types) != set(LAYER_KINDS):
            raise ValueError(
                f"OlmoHybridArgs.layer_types={list(self.layer_types)}; OLMo Hybrid needs linear_attention and "
                "full_attention layers both"
            )


def with_depth(args: OlmoHybridArgs, n_layers: int) -> dict:
    """model.n_layers: the depth, the layer pattern kept (one attention layer every `interval`)."""
    interval = args.layer_types.index("full_attention") + 1
    return {"n_layers": n_layers, "layer_types": olmo_layers(n_layers, interval)}


# The published allenai/Olmo-Hybrid-7B: transformers' OlmoHybridConfig defaults ("a similar configuration to that of
# allenai/Olmo-Hybrid-7B"), 32 layers of which every 4th attention, 30 heads everywhere, linear keys 0.75 x 3840 / 30
# = 96 wide and values twice that; no rotations ("Released ckpt don't use any ROPE", modeling_olmo_hybrid.py).
FLAVORS = {
    # Tiny, for tests and CPU runs: three linear layers and one attention layer, grouped value heads.
    "debug": OlmoHybridArgs(
        **DEBUG_SIZES,
        max_seq_len=2048,
        linear_key_heads=2,
        linear_value_heads=4,
        linear_key_dim=16,
        linear_value_dim=16,
    ),
    "olmo_hybrid_7b": OlmoHybridArgs(
        dim=3840,
        n_layers=32,
        n_heads=30,
        n_kv_heads=30,
        ffn_dim=11008,
        vocab_size=100352,
        max_seq_len=65536,
        rope=False,
    ),
}
