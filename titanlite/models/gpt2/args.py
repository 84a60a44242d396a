"""GPT-2's arguments and sizes, torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from titanlite.models.common.decoder_args import TransformerDefaults
from titanlite.models.spec import not_math

# GPT-2's MLP activations: "gelu_tanh" (GPT-2's tanh approximation) and "gelu" (the exact, erf-based one).
GPT2_ACTIVATIONS = ("gelu_tanh", "gelu")


@dataclass
class GPT2Args(TransformerDefaults):
    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int = not_math()
    max_seq_len: int = not_math(1024)
    norm_eps: float = 1e-5
    # GPT-2 ties its output projection to the token embedding; Hugging Face folders may say otherwise.
    tie_embeddings: bool = True
    ffn_dim: int = 0
    """Width of the MLP's hidden layer; 0 means 4 * dim (GPT-2's, and Hugging Face's n_inner = null)."""
    activation: str = "gelu_tanh"
    """The MLP's GELU: "gelu_tanh" (GPT-2's tanh approximation) or "gelu" (the exact, erf-based one)."""
    family: ClassVar[str] = "gpt2"  # the spec these arguments belong to (not a field: checkpoints keep theirs)
    layer_types: ClassVar[tuple[str, ...]] = ()  # every layer attends alike

    def __post_init__(self) -> None:
        if not self.ffn_dim:
            self.ffn_dim = 4 * self.dim
        if self.activation not in GPT2_ACTIVATIONS:
            raise ValueError(f"GPT2Args.activation={self.activation!r}; use one of {', '.join(GPT2_ACTIVATIONS)}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


# vocab_size 0: the tokenizer's, padded to a multiple of 64.
FLAVORS = {
    "debug": GPT2Args(dim=64, n_layers=4, n_heads=4, vocab_size=0),
    "124M": GPT2Args(dim=768, n_layers=12, n_heads=12, vocab_size=0),
    "355M": GPT2Args(dim=1024, n_layers=24, n_heads=16, vocab_size=0),
    "774M": GPT2Args(dim=1280, n_layers=36, n_heads=20, vocab_size=0),
    "1.5B": GPT2Args(dim=1600, n_layers=48, n_heads=25, vocab_size=0),
}


def tp_split_sizes(args: GPT2Args) -> dict[str, int]:
    """The sizes a tensor-parallel degree must divide: heads, the MLP width, the vocabulary."""
    return {"n_heads": args.n_heads, "ffn_dim": args.ffn_dim, "vocab_size": args.vocab_size}
