"""The dense feed-forwards of the shared blocks (titanlite/models/common/decoder.py): the gated MLP (SwiGLU, or
GELU-tanh gated) and the plain two-layer MLP. The mixture of experts is titanlite/models/common/moe/."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.models.common.init_scheme import InitScheme, start_linears


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 (Primer's; Nemotron-H's MLP, transformers' "relu2")."""
    return torch.square(F.relu(x))


# Our activation names -> the function of the gate (or, in the plain MLP, of the hidden layer).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": gelu_tanh,
    "gelu": F.gelu,
    "relu2": relu_squared,
}


class GatedMLP(nn.Module):
    """w2(act(w1 x) * w3 x): SwiGLU with act "silu" (Llama), GELU-tanh gated with "gelu_tanh" (Gemma)."""

    def __init__(self, dim: int, hidden_dim: int, bias: bool = False, activation: str = "silu"):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=bias)  # gate
        self.w2 = nn.Linear(hidden_dim, dim, bias=bias)  # down
        self.w3 = nn.Linear(dim, hidden_dim, bias=bias)  # up
        self.act = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)) * self.w3(x))

    def init_own(self, name: str, full: torch.Tensor, generator: torch.Generator, scheme: InitScheme) -> None:
        start_linears(name, full, generator, scheme, inputs=("w1", "w3"), outputs=("w2",))


class MLP(nn.Module):
    """w2(act(w1 x)), with biases (GPT-2's, GELU-tanh) or without (`bias` False: Nemotron-H's, relu^2)."""

    def __init__(self, dim: int, hidden_dim: int, activation: str = "gelu_tanh", bias: bool = True):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=bias)  # up
        self.w2 = nn.Linear(hidden_dim, dim, bias=bias)  # down
        self.act = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)))

    def init_own(self, name: str, full: torch.Tensor, generator: torch.Generator, scheme: InitScheme) -> None:
        start_linears(name, full, generator, scheme, inputs=("w1",), outputs=("w2",))
