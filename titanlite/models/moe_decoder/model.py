"""The MoE decoder: the Llama decoder (with whichever Q/K norms a family sets) whose blocks hold the shared
mixture-of-experts block (titanlite/models/common/moe.py) instead of the dense feed-forward, except at
moe.dense_layers.

The load-balancing loss is transformers' (load_balancing_loss_func over every layer's router logits at once),
not a sum of per-layer losses: each block records its per-expert token counts and summed router probabilities,
and the model adds ONE term after its blocks,

    aux_loss_coef * n_experts * sum_i f_i * P_i,   f_i = (sum over layers of tokens routed to i) / (L * N),
                                                   P_i = (sum over layers and tokens of i's probability) / (L * N),

L the MoE blocks that ran and N the tokens of the micro-batch. That is not a per-layer sum (f and P are pooled
over the layers before the product), so no per-layer coefficient gives it. A micro-batch may be spread over ranks:
data-parallel ranks hold some of its sequences, context-parallel ranks some of each sequence's tokens. The
statistics are summed over all of them first (PooledBalance.reduce, which the layout sets:
titanlite/parallel/parallelize.py pool_balance_over), so every rank adds the term of the whole micro-batch and the
objective does not depend on the layout. Under gradient accumulation each micro-batch (the i-th of every rank,
together) forms its own term, as transformers does per forward: the objective is that of a run with the same
micro-batches, not of one batch of them all. On a pipeline the pooled statistics travel with the activations: a
stage part before the last returns (h, carry), carry [3, E] its blocks' totals plus those it received
(PooledBalance.totals), and the last part adds the one term from the totals of every stage (summed over its
ranks as above); backward sends the term's gradient through the pipeline's own P2P to each stage's routers, so the
term and its gradients are one process's. The router z-loss, when set, stays per block."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from titanlite.models.common.attention import Sequence
from titanlite.models.common.auxiliary import add_auxiliary_loss
from titanlite.models.common.interface import Decoder
from titanlite.models.common.kv_cache import KVCache
from titanlite.models.common.moe import MoE, Routing, count_step_tokens, router_z_loss
from titanlite.models.common.moe_args import MoEArgs
from titanlite.models.llama3.model import Llama
from titanlite.models.moe_decoder.args import MoEDecoderArgs


class PooledBalance:
    """The routing statistics of one forward's MoE blocks, pooled over the layers (transformers' semantics):
    per-expert token counts (no gradient) and summed router probabilities (the router's gradient)."""

    def __init__(self) -> None:
        # Sums a tensor, differentiably, over the ranks that hold other tokens of the same micro-batch (data and
        # context parallel; the layout sets it: titanlite/parallel/parallelize.py); None: this rank holds them all.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.active = False
        self.counts: list[torch.Tensor] = []
        self.prob_sums: list[torch.Tensor] = []
        self.rows = 0
        self.carry: torch.Tensor | None = None  # the routing totals of the pipeline stages before, during a forward

    def start(self, active: bool) -> None:
        self.active, self.counts, self.prob_sums, self.rows = active, [], [], 0

    def add(self, route: Routing, counts: torch.Tensor) -> None:
        """Record one block's routing. Called in every forward with gradients, recording only while active: a
        backward that recomputes the block (activation checkpointing) must run the ops its forward ran."""
        prob_sum = route.scores.sum(dim=0)  # [E], float32 softmax probabilities
        if self.active:
            self.counts.append(counts)
            self.prob_sums.append(prob_sum)
            self.rows += route.scores.shape[0]

    def loss(self, n_experts: int) -> torch.Tensor:
        """n_experts * sum_i f_i * P_i over every recorded block's tokens (f_i summing to top_k)."""
        return pooled_loss(self.reduced(self.totals(n_experts, self.counts[0].device)), n_experts)

    def reduced(self, totals: torch.Tensor) -> torch.Tensor:
        """Totals [3, E] summed over the ranks that hold other tokens of the same micro-batch (reduce), if any."""
        return totals if self.reduce is None else self.reduce(totals)

    def totals(self, n_experts: int, device: torch.device) -> torch.Tensor:
        """The recorded blocks' statistics as one float32 tensor [3, E], what a pipeline stage hands on: row 0 the
        token counts (integers, exact in float32 up to 2**24), row 1 the probability sums (with the routers'
        gradient), row 2 the pooled rows L * N in every column. Zeros when no block recorded."""
        if not self.counts:
            return torch.zeros(3, n_experts, device=device)
        counts = torch.stack(self.counts).sum(dim=0).float()
        prob_sums = torch.stack(self.prob_sums).sum(dim=0)
        return torch.stack([counts, prob_sums, torch.full_like(counts, self.rows)])


def pooled_loss(totals: torch.Tensor, n_experts: int) -> torch.Tensor:
    """PooledBalance.loss from the totals [3, E] of every stage: the gradient reaches the probability sums only
    (counts and rows are integers; rows is 0 only if no block of the whole model routed, then so is the term)."""
    counts, prob_sums, rows = totals[0].detach(), totals[1], totals[2, 0].detach().clamp(min=1)
    return n_experts * (counts / rows * (prob_sums / rows)).sum()


class PooledMoE(MoE):
    """The shared block, recording its routing in the model's PooledBalance instead of adding its own
    load-balancing term (the model adds one for all blocks); its z-loss term, if any, is added as the block's."""

    def __init__(self, dim: int, args: MoEArgs, balance: PooledBalance):
        super().__init__(dim, args)
        self.balance = balance

    def add_balancing_terms(self, out: torch.Tensor, route: Routing, counts: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            self.balance.add(route, counts)
        if self.args.z_loss_coef > 0:
            out = add_auxiliary_loss(out, "router_z", self.args.z_loss_coef * router_z_loss(route.logits))
        return out


class MoEDecoder(Llama):
    """Implements titanlite.models.common.interface.Decoder: Llama's blocks, their feed_forward a PooledMoE
    at sparse layers (a FeedForward at moe.dense_layers)."""

    args: MoEDecoderArgs

    def __init__(self, args: MoEDecoderArgs):
        # Llama builds a dense feed-forward in every block; the sparse ones are replaced here (the builder works
        # on the meta device, where the replaced ones cost nothing).
        super().__init__(args)
        self.balance = PooledBalance()
        for i, block in self.layers.items():
            if args.moe.is_sparse(int(i)):
                block.feed_forward = PooledMoE(args.dim, args.moe, self.balance)

    def init_buffers(self) -> None:
        """RoPE tables; the step's token counts and the routing bias of balance="bias" start at zero (a checkpoint
        then restores the bias)."""
        super().init_buffers()
        for module in self.modules():
            if isinstance(module, MoE):
                module.step_tokens.zero_()
                if module.router.expert_bias is not None:
                    module.router.expert_bias.zero_()

    def forward(  # type: ignore[override]  # only a pipeline stage part returns (h, carry), as the Decoder allows
        self,
        tokens: torch.Tensor,
        cache: KVCache | None = None,
        sequence: Sequence | None = None,
        *,
        logits: bool = True,
        carry: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Llama's forward, plus the load-balancing term of the blocks that ran (module docstring). With the pooled
        term on (balance "aux_loss", aux_loss_coef > 0), a pipeline stage part without the output head returns
        (h, carry): carry [3, E] the routing totals of its blocks and of the `carry` it received from the stage
        before (PooledBalance.totals; zeros outside training, so every step hands on the same tensors); the part
        that holds the head adds the one term from them. The whole model takes and returns what Llama's does."""
        moe = self.args.moe
        pooled = moe.balance == "aux_loss" and moe.aux_loss_coef > 0
        self.balance.start(torch.is_grad_enabled() and pooled)
        self.balance.carry = carry
        try:
            out = super().forward(tokens, cache, sequence, logits=logits)
        finally:
            self.balance.active = False  # a recomputing backward (activation checkpointing) records nothing
            self.balance.carry = None
        if torch.is_grad_enabled():  # a training forward: its counts join the step's (here, never in a recompute)
            count_step_tokens(self)
        if self.output is not None or not pooled:  # the head's part joined its term in after_blocks
            self.balance.start(False)
            return out
        # A pipeline stage before the last: the routing totals travel with the activations.
        totals = self.balance.totals(moe.n_experts, out.device)
        self.balance.start(False)
        if carry is not None:
            totals = carry + totals
        if torch.is_grad_enabled() and not totals.requires_grad:
            # no routing block before this point: the next stage still sends a gradient for the carry back
            totals.requires_grad_()
        return out, totals

    def after_blocks(self, h: torch.Tensor) -> torch.Tensor:
        """In the part that holds the output head (the whole model, or the last pipeline stage), h with the pooled
        load-balancing term joined: over this part's blocks, or with the routing totals `carry` of the stages
        before (module docstring)."""
        moe = self.args.moe
        if self.output is None:
            return h
        carry = self.balance.carry
        self.balance.active = False
        if carry is None:  # the whole model
            if self.balance.rows:
                h = add_auxiliary_loss(h, "load_balance", moe.aux_loss_coef * self.balance.loss(moe.n_experts))
            return h
        if torch.is_grad_enabled() and moe.balance == "aux_loss" and moe.aux_loss_coef > 0:
            totals = carry + self.balance.totals(moe.n_experts, h.device)
            h = add_auxiliary_loss(
                h, "load_balance", moe.aux_loss_coef * pooled_loss(self.balance.reduced(totals), moe.n_experts)
            )
        return h

    def init_param(self, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
        """The router's gate and each expert's matrices as Llama's linear layers: trunc normal std 0.02, the
        experts' down projection (w2) at the residual std; the rest as Llama's."""
        path, _, leaf = name.rpartition(".")
        parent = path.rpartition(".")[2]
        std = 0.02
        if parent == "experts" and leaf in ("w1", "w3") or parent == "gate" and path.endswith("router.gate"):
            if leaf == "bias":
                nn.init.zeros_(full)
                return
            nn.init.trunc_normal_(full, mean=0.0, std=std, a=-2 * std, b=2 * std, generator=generator)
        elif parent == "experts" and leaf == "w2":
            residual_std = std / (2 * self.args.n_layers) ** 0.5
            nn.init.trunc_normal_(
                full, mean=0.0, std=residual_std, a=-2 * residual_std, b=2 * residual_std, generator=generator
            )
        else:
            super().init_param(name, full, generator)


if TYPE_CHECKING:  # mypy (.ci/run) holds the class to the model interface and names any member that differs

    def _implements_decoder(model: MoEDecoder) -> Decoder:
        return model
