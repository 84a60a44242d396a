"""The load-balancing loss of the pooled kind, transformers' (load_balancing_loss_func over every layer's router
logits at once), not a sum of per-layer losses: each MoE block records its per-expert token counts and summed router
probabilities in the RoutingTally of the forward that runs it, and the decoder (titanlite/models/common/decoder.py)
adds ONE term after its blocks,

    aux_loss_coef * n_experts * sum_i f_i * P_i,   f_i = (sum over layers of tokens routed to i) / (L * N),
                                                   P_i = (sum over layers and tokens of i's probability) / (L * N),

L the MoE blocks that ran and N the tokens of the micro-batch. That is not a per-layer sum (f and P are pooled
over the layers before the product), so no per-layer coefficient gives it. A micro-batch may be spread over ranks:
data-parallel ranks hold some of its sequences, context-parallel ranks some of each sequence's tokens. The
statistics are summed over all of them first (PooledBalance.reduce, which the layout sets:
titanlite/parallel/parallelize.py pool_balance_over), so every rank adds the term of the whole micro-batch and the
objective does not depend on the layout. Under gradient accumulation each micro-batch (the i-th of every rank,
together) forms its own term, as transformers does per forward: the objective is that of a run with the same
micro-batches, not of one batch of them all.

The state is a value, not a flag. Each training forward of the decoder opens one tally (PooledBalance.recording)
around its blocks and closes it when they have run: the blocks record into the open tally, and nothing else does
(a backward that recomputes a block for activation checkpointing runs after the tally closed, and the multi-token
prediction depths run after it too, outside transformers' term). The forward turns the tally into its totals [3, E]
(RoutingTally.totals) and, on a pipeline, adds the `carry` it received: the totals of the stages before, an argument
of the forward. A stage part before the last returns them beside its hidden states, (h, carry)
(titanlite/models/common/interface.py WithCarry), for the next part; the part with the head hands the totals of
every stage to after_blocks, which adds the one term from them (summed over its ranks as above). Backward sends the
term's gradient through the pipeline's own P2P to each stage's routers, so the term and its gradients are one
process's. The router z-loss, when set, stays per block."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from titanlite.models.common.auxiliary import add_auxiliary_loss
from titanlite.models.common.moe.args import MoEArgs
from titanlite.models.common.moe.layer import GroupedExperts, MoE, Routing, router_z_loss


@dataclass
class RoutingTally:
    """The routing statistics of one forward's MoE blocks, pooled over the layers (transformers' semantics):
    per-expert token counts (no gradient) and summed router probabilities (the router's gradient), one entry per
    block that recorded, and the rows (tokens) they routed in all."""

    counts: list[torch.Tensor] = field(default_factory=list)
    prob_sums: list[torch.Tensor] = field(default_factory=list)
    rows: int = 0

    def add(self, counts: torch.Tensor, prob_sum: torch.Tensor, rows: int) -> None:
        self.counts.append(counts)
        self.prob_sums.append(prob_sum)
        self.rows += rows

    def totals(self, n_experts: int, device: torch.device) -> torch.Tensor:
        """The recorded blocks' statistics as one float32 tensor [3, E], what a pipeline stage hands on: row 0 the
        token counts (integers, exact in float32 up to 2**24), row 1 the probability sums (with the routers'
        gradient), row 2 the pooled rows L * N in every column. Zeros when no block recorded."""
        if not self.counts:
            return torch.zeros(3, n_experts, device=device)
        counts = torch.stack(self.counts).sum(dim=0).float()
        prob_sums = torch.stack(self.prob_sums).sum(dim=0)
        return torch.stack([counts, prob_sums, torch.full_like(counts, self.rows)])


class PooledBalance:
    """What a model's pooled MoE blocks share: the sum over the ranks that hold the rest of a micro-batch (`reduce`,
    set once by the layout) and the one place they record into, the tally of the forward running them, open only
    while it runs them (`recording`)."""

    def __init__(self) -> None:
        # Sums a tensor, differentiably, over the ranks that hold other tokens of the same micro-batch (data and
        # context parallel; the layout sets it: titanlite/parallel/parallelize.py); None: this rank holds them all.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._open: RoutingTally | None = None

    @contextmanager
    def recording(self, enabled: bool) -> Iterator[RoutingTally]:
        """A new tally for one forward's blocks: they record into it inside the `with` when `enabled` (a training
        forward), never after it, so a backward that recomputes a block records nothing."""
        tally = RoutingTally()
        self._open = tally if enabled else None
        try:
            yield tally
        finally:
            self._open = None

    def add(self, route: Routing, counts: torch.Tensor) -> None:
        """Record one block's routing in the open tally, if any. Called in every forward with gradients: a backward
        that recomputes the block (activation checkpointing) must run the ops its forward ran."""
        prob_sum = route.scores.sum(dim=0)  # [E], float32 softmax probabilities
        if self._open is not None:
            self._open.add(counts, prob_sum, route.scores.shape[0])

    def reduced(self, totals: torch.Tensor) -> torch.Tensor:
        """Totals [3, E] summed over the ranks that hold other tokens of the same micro-batch (reduce), if any."""
        return totals if self.reduce is None else self.reduce(totals)


def pooled_loss(totals: torch.Tensor, n_experts: int) -> torch.Tensor:
    """n_experts * sum_i f_i * P_i from the totals [3, E] of every block of the model (RoutingTally.totals, f_i
    summing to top_k): the gradient reaches the probability sums only (counts and rows are integers; rows is 0 only
    if no block of the whole model routed, then so is the term)."""
    counts, prob_sums, rows = totals[0].detach(), totals[1], totals[2, 0].detach().clamp(min=1)
    return n_experts * (counts / rows * (prob_sums / rows)).sum()


class PooledMoE(MoE):
    """The shared block, recording its routing in the model's PooledBalance instead of adding its own
    load-balancing term (the model adds one for all blocks); its z-loss term, if any, is added as the block's."""

    def __init__(
        self,
        dim: int,
        args: MoEArgs,
        balance: PooledBalance,
        experts: GroupedExperts | None = None,
        hash_vocab: int = 0,
    ):
        super().__init__(dim, args, experts=experts, hash_vocab=hash_vocab)
        self.balance = balance

    def add_balancing_terms(self, out: torch.Tensor, route: Routing, counts: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            self.balance.add(route, counts)
        if self.args.z_loss_coef > 0:
            out = add_auxiliary_loss(out, "router_z", self.args.z_loss_coef * router_z_loss(route.logits))
        return out
