"""The output head every family ends with: the projection of the final hidden states onto the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class OutputHead(nn.Linear):
    """The output projection [dim -> vocab], a bias-free linear layer whose weight a family may tie to its
    embedding.

    `head(h)` gives logits. `head(h, project=False)` gives h itself: a model's forward asked for its hidden
    states (`logits=False`, what the chunked loss takes, titanlite/components/loss.py) still *calls* its head,
    so whatever acts on module calls sees it in the forward pass as with logits (FSDP gathers the weight the
    loss then reads; a pipeline stage's module is the same either way)."""

    def __init__(self, dim: int, vocab_size: int):
        super().__init__(dim, vocab_size, bias=False)

    def forward(self, h: torch.Tensor, project: bool = True) -> torch.Tensor:
        return F.linear(h, self.weight) if project else h
