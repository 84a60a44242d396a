"""The norms the families share beside torch's own (nn.RMSNorm, nn.LayerNorm): RMSNorm computed in float32, its weight
zero-centred (1 + weight), plain, or absent; and the final RMSNorm whose output carries the logits' multiplier."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.models.common.init_scheme import InitScheme


class Float32RMSNorm(nn.Module):
    """RMSNorm in float32 (then the input's dtype) times its weight: (1 + weight), the weight starting at 0, where
    `zero_centered` (Gemma 3's norm, and the hybrid families': Qwen3.5, Qwen3-Next); the weight itself, starting at 1,
    otherwise (Gemma 4's); no weight with `scale=False` (Gemma 4's value norm)."""

    def __init__(self, dim: int, eps: float, *, zero_centered: bool = False, scale: bool = True):
        super().__init__()
        self.eps, self.zero_centered = eps, zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim)) if scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.weight is not None:
            weight = self.weight.float()
            out = out * (1.0 + weight if self.zero_centered else weight)
        return out.type_as(x)

    def init_own(self, name: str, full: torch.Tensor, generator: torch.Generator, scheme: InitScheme) -> None:
        """The weight at zero where zero-centred (the norm starts as a plain RMSNorm), else at one."""
        if not self.zero_centered:
            scheme.norm(name, full)
        elif name == "weight":
            nn.init.zeros_(full)
        else:
            raise KeyError(f"{type(self).__name__} has no parameter {name!r}")


class ZeroCenteredRMSNorm(Float32RMSNorm):
    """Float32RMSNorm(dim, eps, zero_centered=True), as the families that use it build their norms (and Q/K norms)."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps, zero_centered=True)


class ScaledRMSNorm(nn.RMSNorm):
    """nn.RMSNorm, its output times `multiplier`: a decoder's final norm carrying a multiplier of the logits (muP's:
    Falcon-H1's lm_head_multiplier, Granite 4.0 H's 1 / logits_scaling). The output head is linear without a bias, so
    multiplying its input is the same product, and a loss that applies the head's weight itself (the chunked loss)
    sees it too."""

    def __init__(self, dim: int, eps: float, multiplier: float):
        super().__init__(dim, eps=eps)
        self.multiplier = multiplier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y if self.multiplier == 1.0 else y * self.multiplier

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, multiplier={self.multiplier}"
