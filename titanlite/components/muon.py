"""Muon (K. Jordan et al., 2024; the update scale of Moonshot's "Muon is Scalable for LLM Training", 2025): each
hidden matrix's momentum orthogonalised by a Newton-Schulz iteration before it is applied. A stack of experts'
matrices [E, A, B] is E matrices, each orthogonalised on its own.

On one device (plain tensors) a 2-D parameter's update is torch.optim.Muon's, to the bit: the momentum as torch keeps
it (an exponential average, B <- mu B + (1 - mu) g; Nesterov's update (1 - mu) g + mu B), the iteration in bfloat16 on
the wide orientation of the matrix, scaled to a Frobenius norm of at most 1, decoupled weight decay, and the learning
rate adjusted by the matrix's shape ("original": sqrt(max(1, A / B)); "match_rms_adamw": 0.2 sqrt(max(A, B))).
Where they differ: torch refuses a tensor of more than 2 dimensions; here one of [E, A, B] is E matrices of A x B,
and its learning rate is adjusted by A x B (torch's rule reads the first two dimensions).

Not yet here (issue 56): the parameter groups (AdamW for embeddings, head, norms and biases), the config, and the
distributed forms (FSDP, TP, EP)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)
ADJUSTMENTS = ("original", "match_rms_adamw", "none")


def orthogonalize(update: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float) -> Tensor:
    """The Newton-Schulz iteration's near-orthogonal matrix of the 2-D `update` (U S' V^T with S' about 1 where
    update = U S V^T), in bfloat16: the quintic a X + b (X X^T) X + c (X X^T)^2 X, `steps` times, from the matrix in
    its wide orientation divided by its Frobenius norm (at least eps)."""
    a, b, c = coefficients
    x = update.bfloat16()
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, rows: int, cols: int, adjustment: str) -> float:
    """The learning rate of a rows x cols matrix's orthogonalised update."""
    if adjustment == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjustment == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


class Muon(torch.optim.Optimizer):
    """Muon over matrices (2-D) and stacks of them (3-D: experts); see the module docstring."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr: str = "original",
    ):
        if adjust_lr not in ADJUSTMENTS:
            raise ValueError(f"Muon adjust_lr={adjust_lr!r}; use one of {', '.join(ADJUSTMENTS)}")
        if not 0 <= momentum < 1:
            raise ValueError(f"Muon momentum={momentum}; it must be in [0, 1)")
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=ns_coefficients,
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr=adjust_lr,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim not in (2, 3):
                    raise ValueError(
                        f"Muon orthogonalises matrices and stacks of them; a parameter of shape {tuple(p.shape)} "
                        "belongs with AdamW"
                    )

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                rows, cols = p.shape[-2:]
                matrices = update.reshape(-1, rows, cols)
                ortho = [orthogonalize(m, group["ns_coefficients"], group["ns_steps"], group["eps"]) for m in matrices]
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(torch.stack(ortho).reshape(p.shape), alpha=-adjusted_lr(lr, rows, cols, group["adjust_lr"]))
        return loss
