"""The output head every family ends with: the projection of the final hidden states onto the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.models.common.init_scheme import InitScheme


class OutputHead(nn.Linear):
    """The output projection [dim -> vocab], a bias-free linear layer whose weight a family may tie to its
    embedding; with `softcap` > 0 its logits are capped, softcap * tanh(z / softcap) (Gemma's
    final_logit_softcapping), here and in the chunked loss alike.

    `head(h)` gives logits. `head(h, project=False)` gives h itself: a model's forward asked for its hidden
    states (`logits=False`, what the chunked loss takes, titanlite/components/loss.py) still *calls* its head,
    so whatever acts on module calls sees it in the forward pass as with logits (FSDP gathers the weight the
    loss then reads; a pipeline stage's module is the same either way)."""

    def __init__(self, dim: int, vocab_size: int, softcap: float = 0.0):
        super().__init__(dim, vocab_size, bias=False)
        self.softcap = softcap

    def forward(self, h: torch.Tensor, project: bool = True) -> torch.Tensor:
        if not project:
            return h
        logits = F.linear(h, self.weight)
        return self.softcap * torch.tanh(logits / self.softcap) if self.softcap else logits

    def init_own(self, name: str, full: torch.Tensor, generator: torch.Generator, scheme: InitScheme) -> None:
        if name != "weight":
            raise KeyError(f"OutputHead has no parameter {name!r}")
        scheme.head(full, generator)
