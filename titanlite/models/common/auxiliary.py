"""Auxiliary loss terms: what a model adds to the training loss beside the next-token cross-entropy (a mixture of
experts' load-balancing loss, its router z-loss), named so the log shows each.

A block adds a term where it computes it: `h = add_auxiliary_loss(h, "load_balance", term)` returns h unchanged,
and backward gives the term's parameters the gradient they would get were `term` added to the micro-batch's loss
(its own micro-batch scale included). That works on every layout alike: a pipeline stage adds the terms of its
own blocks, with no loss of its own to add them to. Outside a training step (evaluation, generation, the
planner's meta runs) nothing collects and the terms are left out, so a validation loss is the cross-entropy alone.

The trainer collects (`with collecting(terms):`), then reduces each name's sum like the loss and logs it. A family
names its terms in its spec (`ModelSpec.auxiliary_losses`), so every rank, whatever blocks it holds, reduces the
same list."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor


class AuxiliaryLosses:
    """The terms added during one training step, by name and by forward pass of each model part (`watch`): each
    pass's sum weighted by `value_weight` (1 / micro-batches, as the loss is averaged). `grad_scale` is what the
    trainer multiplies the loss by. A pipeline stage's first step also runs a forward of its own (torch infers
    the stage's shapes, from uninitialised tensors on torch 2.12+); `take` keeps each part's last `passes`."""

    def __init__(self, names: tuple[str, ...]):
        self.names = names
        self.grad_scale = 1.0
        self.value_weight = 1.0
        self.passes: dict[int, list[dict[str, torch.Tensor]]] = {}  # by part: one dict per forward pass
        self.current: dict[str, torch.Tensor] = {}

    def watch(self, part: nn.Module) -> None:
        """Start a new forward pass's sums each time `part` runs forward."""
        part.register_forward_pre_hook(lambda module, args: self.begin_forward(id(module)))

    def begin_forward(self, part: int) -> None:
        self.current = {}
        self.passes.setdefault(part, []).append(self.current)

    def add(self, name: str, term: torch.Tensor) -> None:
        if name not in self.names:
            raise ValueError(f"auxiliary loss {name!r} is not among the family's auxiliary_losses {self.names}")
        value = term.detach().float() * self.value_weight
        self.current[name] = self.current[name] + value if name in self.current else value

    def take(self, device: torch.device, passes: int) -> torch.Tensor:
        """This rank's sums over each part's last `passes` forward passes, in the order of `names` (0 for a name
        its blocks never added); then start afresh."""
        kept = [sums for per_part in self.passes.values() for sums in per_part[-passes:]]
        zero = torch.zeros((), device=device)
        values = torch.stack(
            [sum((sums[name].to(device) for sums in kept if name in sums), zero) for name in self.names]
        )
        self.passes, self.current = {}, {}
        return values


_collecting: AuxiliaryLosses | None = None
_recomputing = False  # inside activation checkpointing's recompute of a block (recomputation)


@contextlib.contextmanager
def collecting(terms: AuxiliaryLosses) -> Iterator[AuxiliaryLosses]:
    """Add the auxiliary terms of the forward passes run inside to the loss and to `terms`."""
    global _collecting
    previous, _collecting = _collecting, terms
    try:
        yield terms
    finally:
        _collecting = previous


@contextlib.contextmanager
def recomputation() -> Iterator[None]:
    """Around activation checkpointing's recompute of a block in backward (titanlite/parallel/
    activation_checkpoint.py): the terms its forward runs again join the recomputed graph as before but are not
    recorded again, the trained forward having recorded them. (A recompute usually stops at the block's last saved
    tensor, before a term added at the block's end; one added inside it, as the sparse attention's, runs again.)"""
    global _recomputing
    previous, _recomputing = _recomputing, True
    try:
        yield
    finally:
        _recomputing = previous


class _JoinLoss(torch.autograd.Function):
    """h unchanged forward; backward also sends `scale` as the gradient of the scalar `term`."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, term: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.term_dtype = scale, term.dtype
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad_h: torch.Tensor):
        grad_term = torch.full((), ctx.scale, dtype=ctx.term_dtype, device=grad_h.device)
        return grad_h, grad_term, None


def record_loss_part(name: str, value: torch.Tensor) -> None:
    """Log `value` under `name` beside the loss, reduced like an auxiliary term, without joining anything to the
    loss: a part the loss function itself already holds (multi-token prediction's depths, components/loss.py).
    Nothing outside a training step."""
    terms = _collecting
    if terms is None or not torch.is_grad_enabled() or _recomputing:
        return
    if isinstance(value, DTensor):  # a replicated loss under loss parallelism
        value = value.to_local()
    terms.add(name, value)


def metric_key(name: str) -> str:
    """The metrics.jsonl key of a logged term: aux_<name> for a term joined to the loss, the name itself for a part
    of the loss (multi-token prediction's mtp_loss, mtp_loss_<k>) and the sparse attention's indexer_loss (a loss of its
    own, logged unweighted)."""
    return name if name.startswith("mtp_loss") or name == "indexer_loss" else f"aux_{name}"


def auxiliary_wanted() -> bool:
    """Whether a term added now joins the loss (inside a training step): a block whose term costs a computation of
    its own (the sparse attention's indexer loss) makes it only then."""
    return _collecting is not None and torch.is_grad_enabled()


def add_auxiliary_loss(h: torch.Tensor, name: str, term: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
    """h, with the scalar `term` joined to the training loss under `name` (see the module's docstring), times
    `weight` (its logged value is `term`'s: a weight of 0 logs the term and trains nothing by it)."""
    terms = _collecting
    if terms is None or not torch.is_grad_enabled():
        return h
    if not _recomputing:
        terms.add(name, term)
    return _JoinLoss.apply(h, term, terms.grad_scale * weight)
