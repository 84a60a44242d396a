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


@dataclass
class LlamaArgs:
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
    """Width of each attention head; 0 means dim // n_heads (some models, e.g. Qwen3 shapes, use others)."""
    rope_scaling: Llama3RopeScaling | None = None

    def __post_init__(self) -> None:
        if not self.head_dim:
            self.head_dim = self.dim // self.n_heads


ModelArgs = GPT2Args | LlamaArgs

# Our model family (model.name) of each kind of arguments.
FAMILY_OF_ARGS = {GPT2Args: "gpt2", LlamaArgs: "llama3"}
