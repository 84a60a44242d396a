"""How parameters start, by their role: what a module that starts its own parameters (its `init_own`) asks for.
Each draw takes only the generator it is handed, so the full values do not depend on the layout
(titanlite/models/common/init.py seeds one generator per parameter and finds the module that starts it)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class InitScheme:
    """The shared scheme: input-side projections trunc normal `std` (within 2 std), residual-side ones (those that
    write into the residual stream: attention's wo, the MLPs' w2) at std / sqrt(2 n_layers) so the stream's
    variance does not grow with depth, the embeddings normal `std`, an untied head trunc normal dim**-0.5 (within 3
    std), a tied head's copy (a pipeline's last stage) as the embedding, norms at one and biases at zero."""

    n_layers: int
    dim: int
    tie_embeddings: bool = False
    std: float = 0.02
    position_std: float = 0.02  # learned positions (GPT-2's are 0.01)

    @property
    def residual_std(self) -> float:
        return self.std / math.sqrt(2 * self.n_layers)

    def projection(self, full: torch.Tensor, generator: torch.Generator) -> None:
        """An input-side projection's weight (a linear layer reading the residual stream or a mixer's inner width)."""
        truncated_normal(full, generator, self.std)

    def residual(self, full: torch.Tensor, generator: torch.Generator) -> None:
        """A residual-side projection's weight: one whose output is added to the residual stream."""
        truncated_normal(full, generator, self.residual_std)

    def normal(self, full: torch.Tensor, generator: torch.Generator) -> None:
        """A plain normal draw of `std` (the embeddings, attention sinks)."""
        nn.init.normal_(full, mean=0.0, std=self.std, generator=generator)

    def embedding(self, full: torch.Tensor, generator: torch.Generator) -> None:
        self.normal(full, generator)

    def positions(self, full: torch.Tensor, generator: torch.Generator) -> None:
        nn.init.normal_(full, mean=0.0, std=self.position_std, generator=generator)

    def head(self, full: torch.Tensor, generator: torch.Generator) -> None:
        """The output head: a tied one's copy as the embedding it is (seeded as tok_embeddings.weight, init.py)."""
        if self.tie_embeddings:
            self.embedding(full, generator)
        else:
            truncated_normal(full, generator, self.dim**-0.5, bound=3.0)

    @staticmethod
    def norm(leaf: str, full: torch.Tensor) -> None:
        """A norm's `weight` at one, its `bias` at zero."""
        if leaf == "weight":
            nn.init.ones_(full)
        elif leaf == "bias":
            nn.init.zeros_(full)
        else:
            raise KeyError(f"a norm has no parameter {leaf!r}")


@dataclass(frozen=True)
class NormalInit(InitScheme):
    """Plain normal draws instead of truncated ones, the head too (std, tied or not): GPT-2's scheme."""

    def projection(self, full: torch.Tensor, generator: torch.Generator) -> None:
        self.normal(full, generator)

    def residual(self, full: torch.Tensor, generator: torch.Generator) -> None:
        nn.init.normal_(full, mean=0.0, std=self.residual_std, generator=generator)

    def head(self, full: torch.Tensor, generator: torch.Generator) -> None:
        self.embedding(full, generator)


def truncated_normal(full: torch.Tensor, generator: torch.Generator, std: float, bound: float = 2.0) -> None:
    """Normal of `std` around zero, redrawn outside +-bound std."""
    nn.init.trunc_normal_(full, mean=0.0, std=std, a=-bound * std, b=bound * std, generator=generator)


def start_linear(leaf: str, full: torch.Tensor, generator: torch.Generator, scheme: InitScheme, residual: bool) -> None:
    """A linear layer's `weight` as an input-side projection, or a residual-side one; its `bias` at zero."""
    if leaf == "bias":
        nn.init.zeros_(full)
    elif leaf != "weight":
        raise KeyError(f"a linear layer has no parameter {leaf!r}")
    elif residual:
        scheme.residual(full, generator)
    else:
        scheme.projection(full, generator)


def start_linears(
    name: str,
    full: torch.Tensor,
    generator: torch.Generator,
    scheme: InitScheme,
    inputs: tuple[str, ...],
    outputs: tuple[str, ...],
) -> None:
    """`name` ("<linear>.weight" or "<linear>.bias") of a module whose linear layers `inputs` are input-side
    projections and `outputs` residual-side ones; a KeyError for any other."""
    child, _, leaf = name.partition(".")
    if child not in inputs and child not in outputs:
        raise KeyError(f"no linear layer {child!r} starts {name!r}")
    start_linear(leaf, full, generator, scheme, residual=child in outputs)
