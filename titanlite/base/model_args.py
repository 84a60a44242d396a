"""The arguments of each model family: plain dataclasses with no torch, so that the configuration and the
reading of a Hugging Face folder's config.json (titanlite/base/hf_config.py) need no torch either."""

from __future__ import annotations

from dataclasses import dataclass

# GPT-2's MLP activations: "gelu_tanh" (GPT-2's tanh approximation) and "gelu" (the exact, erf-based one).
GPT2_ACTIVATIONS = ("gelu_tanh", "gelu")


@dataclass
class GPT2Args:
    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int
    max_seq_len: int = 1024
    norm_eps: float = 1e-5
    # GPT-2 ties its output projection to the token embedding; Hugging Face folders may say otherwise.
    tie_embeddings: bool = True
    ffn_dim: int = 0
    """Width of the MLP's hidden layer; 0 means 4 * dim (GPT-2's, and Hugging Face's n_inner = null)."""
    activation: str = "gelu_tanh"
    """The MLP's GELU: "gelu_tanh" (GPT-2's tanh approximation) or "gelu" (the exact, erf-based one)."""

    def __post_init__(self) -> None:
        if not self.ffn_dim:
            self.ffn_dim = 4 * self.dim
        if self.activation not in GPT2_ACTIVATIONS:
            raise ValueError(f"GPT2Args.activation={self.activation!r}; use one of {', '.join(GPT2_ACTIVATIONS)}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1/3.2's RoPE frequency scaling (config.json rope_scaling with rope_type "llama3"): rotations
    slower than the original context are slowed by `factor`, fast ones are kept, and those in between are
    blended, so the model reads long contexts without retraining its short-range positions
    (titanlite/models/llama.py applies it)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


# The families built by the Llama decoder: model.name -> the Hugging Face model_type it reads and writes.
DECODER_FAMILIES = {
    "llama3": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "smollm3": "smollm3",
    "mistral": "mistral",
    "olmo2": "olmo2",
}
QK_NORMS = ("none", "head", "full")
NORM_POSITIONS = ("pre", "post")


@dataclass
class LlamaArgs:
    """The decoder of Llama 3 and the families that change it by a switch (titanlite/models/llama.py)."""

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
    """Width of each attention head; 0 means dim // n_heads (Qwen3 and Mistral set it: 128)."""
    rope_scaling: Llama3RopeScaling | None = None
    family: str = "llama3"
    """The model.name this shape belongs to: which Hugging Face model_type an export writes (DECODER_FAMILIES)."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (Qwen2; and every family's attention_bias)."""
    out_bias: bool = False
    """A bias on the attention's output projection (attention_bias of Llama, Qwen3, SmolLM3, OLMo2)."""
    mlp_bias: bool = False
    """Biases on the three projections of the SwiGLU feed-forward (Llama's mlp_bias)."""
    qk_norm: str = "none"
    """RMSNorm of queries and keys before RoPE: "head" normalises each head on its own, with one weight of
    head_dim shared by the heads (Qwen3); "full" each token's whole query and key projection (OLMo2)."""
    norm_position: str = "pre"
    """"pre": each sublayer normalises its input (Llama); "post": each normalises its output, before the
    residual add, and the blocks have no input norms (OLMo2)."""
    nope_layers: tuple[int, ...] = ()
    """Layers that apply no rotary position embedding (SmolLM3's NoPE layers: every 4th)."""
    sliding_window: int = 0
    """A Hugging Face model's attention window (Mistral, Qwen), kept for its export; titanlite attends to the
    whole context, which max_seq_len then keeps within the window, where both are the same."""

    def __post_init__(self) -> None:
        if not self.head_dim:
            self.head_dim = self.dim // self.n_heads
        self.nope_layers = tuple(self.nope_layers)
        for name, value, allowed in (
            ("family", self.family, tuple(DECODER_FAMILIES)),
            ("qk_norm", self.qk_norm, QK_NORMS),
            ("norm_position", self.norm_position, NORM_POSITIONS),
        ):
            if value not in allowed:
                raise ValueError(f"LlamaArgs.{name}={value!r}; use one of {', '.join(allowed)}")


ModelArgs = GPT2Args | LlamaArgs


def family_of(args: ModelArgs) -> str:
    """The model.name of a model's arguments."""
    return "gpt2" if isinstance(args, GPT2Args) else args.family
