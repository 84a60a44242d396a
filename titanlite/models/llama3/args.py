"""The Llama decoder's arguments, torch-free: Llama 3's own, and the switches by which other families reuse the
decoder (each such family's folder sets them). Llama 3's sizes."""

from __future__ import annotations

from dataclasses import dataclass

from titanlite.models.common.rope_args import YarnRopeScaling

QK_NORMS = ("none", "head", "full")
NORM_POSITIONS = ("pre", "post")


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1/3.2's RoPE frequency scaling (config.json rope_scaling with rope_type "llama3"): rotations
    slower than the original context are slowed by `factor`, fast ones are kept, and those in between are
    blended, so the model reads long contexts without retraining its short-range positions
    (titanlite/models/llama3/model.py applies it)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass
class LlamaArgs:
    """The Llama decoder (titanlite/models/llama3/model.py) and the switches other families set on it."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    max_seq_len: int = 2048
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    head_dim: int = 0
    """Width of each attention head; 0 means dim // n_heads (some families set it, e.g. 128)."""
    rope_scaling: Llama3RopeScaling | YarnRopeScaling | None = None
    """RoPE frequency scaling: Llama 3.1's, or YaRN (titanlite/models/common/rope_args.py); None: plain RoPE."""
    family: str = "llama3"
    """The model.name (registered spec) this shape belongs to: its Hugging Face config.json, plan and sizes."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (and every family's attention_bias)."""
    out_bias: bool = False
    """A bias on the attention's output projection (attention_bias)."""
    mlp_bias: bool = False
    """Biases on the three projections of the SwiGLU feed-forward (Llama's mlp_bias)."""
    qk_norm: str = "none"
    """RMSNorm of queries and keys before RoPE: "head" normalises each head on its own, with one weight of
    head_dim shared by the heads; "full" each token's whole query and key projection."""
    norm_position: str = "pre"
    """"pre": each sublayer normalises its input (Llama); "post": each normalises its output, before the
    residual add, and the blocks have no input norms."""
    nope_layers: tuple[int, ...] = ()
    """Layers that apply no rotary position embedding (NoPE)."""
    sliding_window: int = 0
    """Sliding-window attention (0: none): a query of a sliding layer sees only the keys fewer than
    sliding_window positions before it, itself included (Mistral, Qwen2 with use_sliding_window)."""
    layer_types: tuple[str, ...] = ()
    """Per layer "sliding_attention" or "full_attention" (config.json's layer_types); empty: every layer slides
    when sliding_window is set."""

    def __post_init__(self) -> None:
        if not self.head_dim:
            self.head_dim = self.dim // self.n_heads
        self.nope_layers = tuple(self.nope_layers)
        self.layer_types = tuple(self.layer_types)
        if self.layer_types and len(self.layer_types) != self.n_layers:
            raise ValueError(f"LlamaArgs.layer_types has {len(self.layer_types)} entries for {self.n_layers} layers")
        for name, value, allowed in (
            ("qk_norm", self.qk_norm, QK_NORMS),
            ("norm_position", self.norm_position, NORM_POSITIONS),
        ):
            if value not in allowed:
                raise ValueError(f"LlamaArgs.{name}={value!r}; use one of {', '.join(allowed)}")


def every(interval: int, n_layers: int) -> tuple[int, ...]:
    """Layer indices i with (i + 1) % interval == 0 (a NoPE pattern such as no_rope_layer_interval's)."""
    return tuple(i for i in range(n_layers) if (i + 1) % interval == 0)


def debug(family: str, **switches) -> LlamaArgs:
    """A tiny decoder of `family` for tests and CPU runs: dim 64, 4 layers, 4 heads (2 for keys and values)."""
    shape = {"dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 192, "vocab_size": 0}
    return LlamaArgs(**(shape | switches), family=family)


def tp_split_sizes(args: LlamaArgs) -> dict[str, int]:
    """The sizes a tensor-parallel degree must divide: query and key/value heads, the MLP width, the vocabulary."""
    return {
        "n_heads": args.n_heads,
        "n_kv_heads": args.n_kv_heads,
        "ffn_dim": args.ffn_dim,
        "vocab_size": args.vocab_size,
    }


def with_depth(args: LlamaArgs, n_layers: int) -> dict:
    """The fields that change with model.n_layers: the depth, and a NoPE pattern kept at the new depth."""
    depth: dict = {"n_layers": n_layers}
    if args.nope_layers:
        depth["nope_layers"] = every(args.nope_layers[0] + 1, n_layers)
    return depth


LLAMA3_VOCAB = 128256  # Llama 3's tokenizer (tiktoken-based, 128,000 ids and 256 reserved special ones)
LLAMA31_ROPE_SCALING = Llama3RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)

# vocab_size 0: the tokenizer's, padded to a multiple of 64.
FLAVORS = {
    "debug": debug("llama3"),
    # Llama 3.2 1B.
    "1B": LlamaArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=8192,
        vocab_size=0,
        max_seq_len=8192,
        tie_embeddings=True,
    ),
    # A 3B of Llama's architecture at the widths of a published 3B (RoPE in every layer).
    "3B": LlamaArgs(
        dim=2048,
        n_layers=36,
        n_heads=16,
        n_kv_heads=4,
        ffn_dim=11008,
        vocab_size=0,
        max_seq_len=8192,
        tie_embeddings=True,
    ),
    # Llama 3.1 8B, 70B and 405B: their shapes, their 128,256-id vocabulary, untied, RoPE theta 500,000 with
    # Llama 3.1's frequency scaling, 131,072 positions. Trained with a smaller tokenizer (the GPT-2 one of
    # the debug configs), the embedding rows past its ids are simply never used.
    "8B": LlamaArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        vocab_size=LLAMA3_VOCAB,
        max_seq_len=131072,
        rope_scaling=LLAMA31_ROPE_SCALING,
    ),
    "70B": LlamaArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim=28672,
        vocab_size=LLAMA3_VOCAB,
        max_seq_len=131072,
        rope_scaling=LLAMA31_ROPE_SCALING,
    ),
    "405B": LlamaArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim=53248,
        vocab_size=LLAMA3_VOCAB,
        max_seq_len=131072,
        rope_scaling=LLAMA31_ROPE_SCALING,
    ),
}


def window_of(args: LlamaArgs, layer: int) -> int | None:
    """The attention window of layer `layer` (None: full causal attention)."""
    if not args.sliding_window:
        return None
    if args.layer_types and args.layer_types[layer] != "sliding_attention":
        return None
    return args.sliding_window
