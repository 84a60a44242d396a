"""The norms the families share beside torch's own (nn.RMSNorm, nn.LayerNorm): the zero-centred RMSNorm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.models.common.init_scheme import InitScheme


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm that multiplies by (1 + weight), weight starting at 0, all in float32 (then the input's dtype):
    Gemma's norm, and the hybrid families' (Qwen3.5, Qwen3-Next)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * (1.0 + self.weight.float())
        return out.type_as(x)

    def init_own(self, name: str, full: torch.Tensor, generator: torch.Generator, scheme: InitScheme) -> None:
        """The weight at zero: the norm starts as a plain RMSNorm."""
        if name != "weight":
            raise KeyError(f"ZeroCenteredRMSNorm has no parameter {name!r}")
        nn.init.zeros_(full)
