"""The MoE decoder: the Llama decoder (with whichever Q/K norms a family sets) whose blocks hold the shared
mixture-of-experts block (titanlite/models/common/moe.py) instead of the dense feed-forward, except at
moe.dense_layers.

The load-balancing loss is transformers' (load_balancing_loss_func over every layer's router logits at once),
not a sum of per-layer losses: each block records its per-expert token counts and summed router probabilities,
and the model adds ONE term after its blocks,

    aux_loss_coef * n_experts * sum_i f_i * P_i,   f_i = (sum over layers of tokens routed to i) / (L * N),
                                                   P_i = (sum over layers and tokens of i's probability) / (L * N),

L the MoE blocks that ran and N the tokens of the forward (a micro-batch on one rank). That is not a per-layer
sum (f and P are pooled over the layers before the product), so no per-layer coefficient gives it. On a
pipeline, each stage pools the blocks it holds. The router z-loss, when set, stays per block."""

from __future__ import annotations

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
        self.active = False
        self.counts: list[torch.Tensor] = []
        self.prob_sums: list[torch.Tensor] = []
        self.rows = 0

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
        fraction = torch.stack(self.counts).sum(dim=0).float() / self.rows
        mean_prob = torch.stack(self.prob_sums).sum(dim=0) / self.rows
        return n_experts * (fraction * mean_prob).sum()


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

    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache | None = None,
        sequence: Sequence | None = None,
        *,
        logits: bool = True,
    ) -> torch.Tensor:
        """Llama's forward, plus the load-balancing term of the blocks that ran (module docstring)."""
        moe = self.args.moe
        self.balance.start(torch.is_grad_enabled() and moe.balance == "aux_loss" and moe.aux_loss_coef > 0)
        try:
            out = super().forward(tokens, cache, sequence, logits=logits)
        finally:
            self.balance.active = False  # a recomputing backward (activation checkpointing) records nothing
        if self.balance.rows:
            out = add_auxiliary_loss(out, "load_balance", moe.aux_loss_coef * self.balance.loss(moe.n_experts))
        self.balance.start(False)
        if torch.is_grad_enabled():  # a training forward: its counts join the step's (here, never in a recompute)
            count_step_tokens(self)
        return out

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
