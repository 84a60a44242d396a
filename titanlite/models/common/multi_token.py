"""Multi-token prediction (DeepSeek-V3's sequential modules, its report's section 2.2): depth k of D combines each
position's hidden state of depth k-1 with the embedding of the token k places ahead and runs one more block, whose
normed output the shared head turns into logits for the token k+1 places ahead.

    h_k = norm_k(Block_k(eh_proj_k(cat[enorm_k(Emb(t_{i+k})), hnorm_k(h_{k-1})])))

h_0 is the main model's output after its final norm, what its head reads, and each depth hands its normed output to
the next, as Megatron-LM's MultiTokenPredictionLayer does (the concatenation's order, embedding first, is that of
DeepSeek's eh_proj weights in the published folders and of vLLM, SGLang and Megatron-LM). The embedding and the head
are the main model's own parameters. The block is a decoder layer like the others (`layers.{n_layers + k - 1}`, built
by the family's build_layer), so every parallelism's plan reaches it; this module holds what surrounds it."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Protocol

import torch
from torch import nn

from titanlite.models.common.init_scheme import InitScheme, start_linears

IGNORE = -100  # F.cross_entropy's ignore_index: a position without a target


class AroundDepth(Protocol):
    """What surrounds a multi-token prediction depth's block, as the decoder calls it (MultiTokenProjection says
    what each member does; DeepSeek-V4's over several streams: hyper_connections.py HyperMultiTokenProjection)."""

    reads_residual: ClassVar[bool]

    def __call__(self, embedded: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor: ...

    def outputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class MultiTokenProjection(nn.Module):
    """One depth's norms and projection around its block: `enorm` of the shifted tokens' embeddings, `hnorm` of the
    previous depth's hidden states, `eh_proj` [2 dim -> dim] of their concatenation, and `norm`, the final norm
    before the shared head (DeepSeek's shared_head.norm).

    What a depth's surroundings declare to the decoder (models/common/decoder.py predict_ahead): forward(embedded,
    hidden) makes the block's input, `outputs` turns the block's output into what the head reads and what the next
    depth takes as `hidden`, and `reads_residual` says whether depth 1's `hidden` is the main model's residual
    before its final norm (and before its streams are folded), or, as here, its normed output."""

    reads_residual: ClassVar[bool] = False

    def __init__(self, dim: int, norm: Callable[[], nn.Module]):
        super().__init__()
        self.enorm = norm()
        self.hnorm = norm()
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.norm = norm()

    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))

    def outputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's output x -> (what the head reads, the next depth's hidden): its normed output, both."""
        h = self.norm(x)
        return h, h

    def init_own(self, name: str, full: torch.Tensor, generator: torch.Generator, scheme: InitScheme) -> None:
        """eh_proj input-side (the norms start as their own kind does)."""
        start_linears(name, full, generator, scheme, inputs=("eh_proj",), outputs=())


def future_labels(labels: torch.Tensor, depth: int) -> torch.Tensor:
    """[B, T] next-token labels -> [B, T, depth + 1]: column j is the token j + 1 places ahead of each position
    (column 0 the labels themselves), IGNORE past the window's end (and where the labels already ignore). Made over
    the whole window before a context-parallel split, so the tokens ahead of a rank's slice come with it."""
    columns = [labels]
    for j in range(1, depth + 1):
        shifted = torch.full_like(labels, IGNORE)
        shifted[:, :-j] = labels[:, j:]
        columns.append(shifted)
    return torch.stack(columns, dim=-1)
