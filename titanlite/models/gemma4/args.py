"""Gemma 4's arguments, torch-free: the shared decoder's (DecoderArgs: sliding and full layers by layer_types) and
what only Gemma 4 has (wider heads and fewer key/value heads on the full layers, keys equal to values there,
proportional rotary, per-layer embeddings, layers that reuse earlier layers' keys and values, a dense MLP beside a
mixture of experts in every layer, the final logit softcap); its published text sizes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from titanlite.models.common.decoder_args import DecoderArgs
from titanlite.models.common.moe.args import MoEArgs
from titanlite.models.spec import not_math


@dataclass
class Gemma4Args(DecoderArgs):
    """Gemma 4's text decoder (titanlite/models/gemma4/model.py): per-head Q/K norms and a weightless value norm,
    scores unscaled (scale 1), norms before and after each sublayer multiplying by their weight, embeddings scaled
    by sqrt(dim), GELU-tanh gated MLPs. head_dim, n_kv_heads and rope_local_theta are the sliding layers'."""

    family: str = not_math("gemma4")
    qk_norm: str = "head"
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    rope_theta: float = 1e6
    """The full layers' rotary base (rope_parameters full_attention rope_theta)."""
    rope_local_theta: float = 10000.0
    """The sliding layers' rotary base (rope_parameters sliding_attention rope_theta)."""
    rotary_fraction: float = 0.25
    """The full layers' proportional RoPE: int(rotary_fraction * global_head_dim // 2) channel pairs turn, at
    rope_theta^(-2i / global_head_dim), the rest not at all (partial_rotary_factor; 1.0: every pair)."""
    rope_factor: float = 1.0
    """The full layers' frequencies divided by it (proportional RoPE's factor)."""
    global_head_dim: int = 0
    """The full layers' head width (global_head_dim); 0: head_dim."""
    n_global_kv_heads: int = 0
    """The full layers' key/value heads when keys equal values (num_global_key_value_heads); 0: n_kv_heads."""
    k_eq_v: bool = False
    """The full layers have no value projection: their values are the keys' projection, before the key norm and
    rotation, through the value norm (attention_k_eq_v)."""
    per_layer_dim: int = 0
    """Per-layer embeddings (hidden_size_per_layer_input; 0: none): each layer adds a gated projection of its own
    slice of a second token embedding, mixed with a projection of the scaled embeddings."""
    kv_shared_layers: int = 0
    """The last kv_shared_layers layers compute no keys or values: each reuses those of the last earlier layer of
    its kind (num_kv_shared_layers)."""
    double_wide_mlp: bool = False
    """The layers that reuse keys and values have MLPs twice ffn_dim wide (use_double_wide_mlp)."""
    final_softcap: float = 0.0
    """Logits become final_softcap * tanh(logits / final_softcap) (final_logit_softcapping; 0: none)."""
    moe: MoEArgs | None = None
    """A mixture of experts beside the dense MLP in every layer (enable_moe_block); None: dense only."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.qk_norm != "head" or self.norm_position != "pre" or self.nope_layers or self.rope_scaling:
            raise ValueError("Gemma4Args: qk_norm is 'head', norm_position 'pre', no nope_layers or rope_scaling")
        if self.mlp_bias:
            raise ValueError("Gemma4Args.mlp_bias: Gemma 4's MLPs have no biases")
        if self.rotary_dim != self.head_dim:
            raise ValueError(
                f"Gemma4Args.rotary_dim={self.rotary_dim}: Gemma 4 rotates whole sliding heads and the full layers' "
                "rotary_fraction (set that)"
            )
        if self.layer_types and self.layer_types[-1] != "full_attention":
            raise ValueError("Gemma4Args.layer_types: the last layer is full_attention (transformers makes it so)")
        if not self.global_head_dim:
            self.global_head_dim = self.head_dim
        if not self.n_global_kv_heads:
            self.n_global_kv_heads = self.n_kv_heads
        if not self.k_eq_v and self.n_global_kv_heads != self.n_kv_heads:
            raise ValueError("Gemma4Args.n_global_kv_heads differs from n_kv_heads only with k_eq_v")
        if not 0 <= self.kv_shared_layers < self.n_layers:
            raise ValueError(f"Gemma4Args.kv_shared_layers={self.kv_shared_layers}; use 0 to n_layers - 1")
        if self.kv_shared_layers and set(self.kinds()[: self.first_shared]) != set(self.kinds()):
            raise ValueError(
                "Gemma4Args: every layer kind that reuses keys and values needs an earlier one of its kind"
            )
        if not 0 < self.rotary_fraction <= 1 or self.rotated_pairs < 1:
            raise ValueError(f"Gemma4Args.rotary_fraction={self.rotary_fraction}; it must turn at least one pair")
        if self.moe is not None and self.moe.dense_layers:
            raise ValueError("Gemma4Args.moe.dense_layers: Gemma 4's mixture of experts is in every layer")

    def kinds(self) -> tuple[str, ...]:
        """Each layer's kind: layer_types, or every layer full without them."""
        return self.layer_types or ("full_attention",) * self.n_layers

    @property
    def first_shared(self) -> int:
        """The first layer that reuses an earlier layer's keys and values (n_layers: none does)."""
        return self.n_layers - self.kv_shared_layers

    @property
    def rotated_pairs(self) -> int:
        """The channel pairs of a full layer's heads that rotate (transformers' rope_angles)."""
        return int(self.rotary_fraction * self.global_head_dim // 2)

    def kv_mode(self, layer: int) -> str:
        """ "reuse": the layer takes an earlier layer's keys and values; "store": it is the last layer of its kind
        before those that reuse, and hands its keys and values on; "own": neither."""
        if not self.kv_shared_layers:
            return "own"
        if layer >= self.first_shared:
            return "reuse"
        kinds = self.kinds()
        last = max(i for i in range(self.first_shared) if kinds[i] == kinds[layer])
        return "store" if layer == last else "own"

    def attention_shape(self, layer: int) -> tuple[int, int]:
        """(head width, key/value heads) of `layer`."""
        if self.kinds()[layer] == "full_attention":
            return self.global_head_dim, self.n_global_kv_heads
        return self.head_dim, self.n_kv_heads

    def ffn_width(self, layer: int) -> int:
        return self.ffn_dim * (2 if self.double_wide_mlp and self.kv_mode(layer) == "reuse" else 1)


def layer_types(n_layers: int, pattern: int = 6) -> tuple[str, ...]:
    """Every `pattern`-th layer full, the others sliding (the last must be full: transformers makes it so)."""
    return tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers))


def with_depth(args: Gemma4Args, n_layers: int) -> dict:
    """model.n_layers: the depth, the flavor's layer pattern at it (the last layer full, as transformers makes it),
    and as many layers reusing keys and values as leave each kind a layer that computes them."""
    full = [i for i, kind in enumerate(args.layer_types) if kind == "full_attention"]
    pattern = full[0] + 1 if full else n_layers
    kinds = layer_types(n_layers, pattern)[:-1] + ("full_attention",) if args.layer_types else ()
    shared = min(args.kv_shared_layers, max(n_layers - pattern, 0))
    return {"n_layers": n_layers, "layer_types": kinds, "kv_shared_layers": shared}


def split_sizes(args: Gemma4Args) -> dict[str, int]:
    sizes = {
        "n_heads": args.n_heads,
        "n_kv_heads": args.n_kv_heads,
        "n_global_kv_heads": args.n_global_kv_heads,
        "ffn_dim": args.ffn_dim,
        "vocab_size": args.vocab_size,
    }
    return sizes


def tp_refusal(args: Gemma4Args) -> str | None:
    if args.per_layer_dim:
        return "per-layer embeddings (hidden_size_per_layer_input), which every layer reads for the whole sequence"
    return None


def pp_refusal(args: Gemma4Args) -> str | None:
    """A stage would lack the per-layer embeddings' table (the first stage's) or the layer that computes the keys
    and values a shared layer reuses."""
    if args.per_layer_dim:
        return "per-layer embeddings (hidden_size_per_layer_input), which the first stage computes for every layer"
    if args.kv_shared_layers:
        return "layers reusing earlier layers' keys and values (num_kv_shared_layers), which a later stage would lack"
    return None


GEMMA4_VOCAB = 262144


def _moe(n_experts: int, top_k: int, expert_dim: int) -> MoEArgs:
    # Softmax over every expert, the top k renormalised (then each times its per-expert scale: the model's).
    return MoEArgs(n_experts=n_experts, top_k=top_k, expert_dim=expert_dim, norm_topk_prob=True)


DEBUG = Gemma4Args(
    dim=64,
    n_layers=6,
    n_heads=4,
    n_kv_heads=4,
    head_dim=16,
    ffn_dim=128,
    vocab_size=0,
    sliding_window=16,
    layer_types=layer_types(6, 2),
    global_head_dim=32,
    n_global_kv_heads=2,
    k_eq_v=True,
    kv_shared_layers=2,
    double_wide_mlp=True,
    final_softcap=30.0,
)

FLAVORS = {
    # Tiny, for tests and CPU runs: sliding and full layers (the full ones with heads twice as wide over half the
    # key/value heads, keys equal to values, proportional rotary), the last two layers reusing keys and values, the
    # softcap. No per-layer embeddings, which tensor parallelism cannot split (the unit tests build models with them).
    "debug": DEBUG,
    # google/gemma-4-E2B, -E4B and -31B, text_config of their config.json (docs/models-dense.md#gemma-4).
    "gemma4_e2b": Gemma4Args(
        dim=1536, n_layers=35, n_heads=8, n_kv_heads=1, head_dim=256, ffn_dim=6144, vocab_size=GEMMA4_VOCAB,
        max_seq_len=131072, sliding_window=512, layer_types=layer_types(35, 5), global_head_dim=512,
        per_layer_dim=256, kv_shared_layers=20, double_wide_mlp=True, final_softcap=30.0,
    ),
    "gemma4_e4b": Gemma4Args(
        dim=2560, n_layers=42, n_heads=8, n_kv_heads=2, head_dim=256, ffn_dim=10240, vocab_size=GEMMA4_VOCAB,
        max_seq_len=131072, sliding_window=512, layer_types=layer_types(42, 6), global_head_dim=512,
        per_layer_dim=256, kv_shared_layers=18, final_softcap=30.0,
    ),
    "gemma4_31b": Gemma4Args(
        dim=5376, n_layers=60, n_heads=32, n_kv_heads=16, head_dim=256, ffn_dim=21504, vocab_size=GEMMA4_VOCAB,
        max_seq_len=262144, sliding_window=1024, layer_types=layer_types(60, 6), global_head_dim=512,
        n_global_kv_heads=4, k_eq_v=True, final_softcap=30.0,
    ),
}  # fmt: skip

# The family "gemma4_moe" (titanlite/models/gemma4/moe_family.py): the mixture-of-experts sizes under their own
# model.name, so that each family has its "debug" flavor. A gemma4_text config.json with enable_moe_block reads as
# family "gemma4" (one config.json reader); the two families build the same module from the same arguments.
MOE_FLAVORS = {
    # The tiny Gemma 4 with a mixture of 8 experts (top 2, width 32) beside the MLP in every layer; no layers reuse
    # keys and values.
    "debug": dataclasses.replace(
        DEBUG, family="gemma4_moe", moe=_moe(8, 2, 32), kv_shared_layers=0, double_wide_mlp=False
    ),
    # google/gemma-4-26B-A4B, text_config of its config.json.
    "gemma4_26b_a4b": Gemma4Args(
        dim=2816, n_layers=30, n_heads=16, n_kv_heads=8, head_dim=256, ffn_dim=2112, vocab_size=GEMMA4_VOCAB,
        max_seq_len=262144, sliding_window=1024, layer_types=layer_types(30, 6), global_head_dim=512,
        n_global_kv_heads=2, k_eq_v=True, final_softcap=30.0, moe=_moe(128, 8, 704), family="gemma4_moe",
    ),
}  # fmt: skip
