"""The mixture-of-experts step hook: after each optimizer step, each MoE block's token counts of the step, summed
over the ranks that route other tokens through it, move its routing bias (balance "bias") and give the log's
expert load. Nothing is read on the host: the load stays on the device until a logging step reads it."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from titanlite.models.common.moe.layer import MoE, expert_load, update_balance_bias


class ExpertBalance:
    """The after_optimizer_step hook of a model with MoE blocks (titanlite.engine.trainer.RankModel).

    `group`: the ranks that see other tokens of the same blocks (data parallel x context parallel; tensor-parallel
    ranks see the same tokens, so they are not in it), None on one rank. `pp_group`: the pipeline's ranks, whose
    stages hold other blocks: the worst block's load is taken over them all."""

    def __init__(
        self,
        parts: list[nn.Module],
        device: torch.device,
        group: dist.ProcessGroup | None,
        pp_group: dist.ProcessGroup | None,
    ):
        self.blocks = [m for part in parts for m in part.modules() if isinstance(m, MoE)]
        self.device, self.group, self.pp_group = device, group, pp_group
        self.load: torch.Tensor | None = None  # the last step's, a device scalar

    @torch.no_grad()
    def __call__(self, step: int) -> None:
        """After optimizer step `step`: sum the step's counts over `group`, move the biases, keep the load, and
        start the next step's counts at zero."""
        if not self.blocks:  # a pipeline stage of dense layers only: it joins the pipeline's maximum
            self.load = self.worst(torch.zeros((), device=self.device))
            return
        counts = torch.stack([block.step_tokens for block in self.blocks])  # [L, E], int64
        if self.group is not None:
            dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=self.group)
        for block, block_counts in zip(self.blocks, counts):
            if block.router.expert_bias is not None:
                update_balance_bias(block, block_counts, block.args.bias_update_rate)
            block.step_tokens.zero_()
        self.load = self.worst(torch.stack([expert_load(block_counts) for block_counts in counts]).max())

    def worst(self, load: torch.Tensor) -> torch.Tensor:
        """The largest of every pipeline stage's load."""
        if self.pp_group is not None:
            dist.all_reduce(load, op=dist.ReduceOp.MAX, group=self.pp_group)
        return load
