"""Gemma 3's arguments, torch-free: the Llama decoder's (DecoderArgs, whose window switches give each block its
sliding or full attention) and what only Gemma 3 has; its published text sizes."""

from __future__ import annotations

from dataclasses import dataclass, field

from titanlite.models.common.decoder_args import DecoderArgs
from titanlite.models.common.rope_args import LayerRope
from titanlite.models.spec import not_math


@dataclass
class Gemma3Args(DecoderArgs):
    """Gemma 3's text decoder (titanlite/models/gemma3/model.py): every block has per-head Q/K norms (qk_norm
    "head") and norms before and after each sublayer; its embeddings are scaled by sqrt(dim), its norms multiply
    by (1 + weight), its MLP is GELU-tanh gated."""

    family: str = not_math("gemma3")
    qk_norm: str = "head"
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    rope_theta: float = 1e6
    query_pre_attn_scalar: float = 256.0
    """Attention scores are scaled by query_pre_attn_scalar**-0.5 (not head_dim**-0.5)."""
    rope_local_theta: float = 10000.0
    """The RoPE base of the sliding layers (rope_local_base_freq); rope_theta is the full layers'."""
    rope_linear_factor: float = 1.0
    """Linear RoPE scaling of the full layers only (rope_scaling {"rope_type": "linear", "factor": ...}):
    their rotation frequencies divided by it."""
    layer_rope: dict[str, LayerRope] = field(default_factory=dict)
    """Derived from rope_theta, rope_linear_factor and rope_local_theta, whatever is passed (the shared decoder
    builds the two tables from it): the full layers' base and linear factor, the sliding layers' base."""

    def __post_init__(self) -> None:
        self.layer_rope = {
            "full_attention": LayerRope(self.rope_theta, linear_factor=self.rope_linear_factor),
            "sliding_attention": LayerRope(self.rope_local_theta),
        }
        super().__post_init__()
        if self.qk_norm != "head" or self.norm_position != "pre" or self.nope_layers or self.rope_scaling:
            raise ValueError("Gemma3Args: qk_norm is 'head', norm_position 'pre', no nope_layers or llama3 scaling")
        if self.rotary_dim != self.head_dim:
            raise ValueError(f"Gemma3Args.rotary_dim={self.rotary_dim}: Gemma 3 rotates whole heads")


def layer_types(n_layers: int, pattern: int = 6) -> tuple[str, ...]:
    """Gemma 3's layer pattern: every `pattern`-th layer full, the others sliding (config.json's
    sliding_window_pattern, 6: five sliding to one full)."""
    return tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers))


def with_depth(args: DecoderArgs, n_layers: int) -> dict:
    """The fields that change with model.n_layers: the depth, and the flavor's layer pattern at the new depth."""
    full = [i for i, kind in enumerate(args.layer_types) if kind == "full_attention"]
    pattern = full[0] + 1 if full else n_layers + 1
    return {"n_layers": n_layers, "layer_types": layer_types(n_layers, pattern) if args.layer_types else ()}


GEMMA3_VOCAB = 262144  # Gemma 3's tokenizer (the 1B text model embeds exactly these)
GEMMA3_MM_VOCAB = 262208  # the 4B, 12B and 27B text configs: 64 more rows (image tokens among them)


def _gemma3(dim, n_layers, n_heads, n_kv_heads, head_dim, ffn_dim, vocab_size, context, window, scalar, factor):
    return Gemma3Args(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        ffn_dim=ffn_dim,
        vocab_size=vocab_size,
        max_seq_len=context,
        sliding_window=window,
        layer_types=layer_types(n_layers),
        query_pre_attn_scalar=scalar,
        rope_linear_factor=factor,
    )


FLAVORS = {
    # Tiny, for tests and CPU runs: every other layer full, so both RoPE bases and both masks run.
    "debug": Gemma3Args(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        ffn_dim=192,
        vocab_size=0,
        sliding_window=16,
        layer_types=layer_types(4, 2),
        query_pre_attn_scalar=16,
        rope_linear_factor=8.0,
    ),
    # google/gemma-3-{1b,4b,12b,27b}-pt text models (their config.json / text_config).
    "gemma3_1b": _gemma3(1152, 26, 4, 1, 256, 6912, GEMMA3_VOCAB, 32768, 512, 256, 1.0),
    "gemma3_4b": _gemma3(2560, 34, 8, 4, 256, 10240, GEMMA3_MM_VOCAB, 131072, 1024, 256, 8.0),
    "gemma3_12b": _gemma3(3840, 48, 16, 8, 256, 15360, GEMMA3_MM_VOCAB, 131072, 1024, 256, 8.0),
    "gemma3_27b": _gemma3(5376, 62, 32, 16, 128, 21504, GEMMA3_MM_VOCAB, 131072, 1024, 168, 8.0),
}
