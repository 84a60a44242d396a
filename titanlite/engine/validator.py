"""Validation: the token-mean loss over fixed held-out windows, on any layout (`titanlite eval` runs it alone).

Every evaluation visits the same windows in corpus order (the whole validation split, or its first
`validation.steps` batches). Where the windows come from several sources (a mixture's held-out tails, the sources'
validation files), each is a validation set of its own, batched apart (the first `validation.steps` batches of each),
and its loss is logged as val_loss/<name> beside the loss over all of them. The last batch is padded with ignored
rows, so no window is dropped or counted twice whatever the data-parallel degree. Evaluation runs without gradients,
in eval mode, reads no training data and draws no random numbers: a run with validation trains exactly as one
without.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titanlite.components.loss import IGNORE
from titanlite.engine.trainer import RankModel, local_value


def eval_batches(
    windows, local_batch_size: int, steps: int, dp_rank: int, dp_degree: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's (inputs, labels) of each validation batch: rank r reads rows r*local ... (r+1)*local - 1
    of each global batch of local x dp windows. Rows past the evaluated windows are padding (inputs 0,
    labels IGNORE), so every rank runs the same number of batches, as FSDP, TP and PP need."""
    per_batch = local_batch_size * dp_degree
    total = num_windows(len(windows), local_batch_size, steps, dp_degree)
    width = len(windows[0])
    for first in range(0, total, per_batch):
        rows = []
        for j in range(local_batch_size):
            index = first + dp_rank * local_batch_size + j
            rows.append(windows[index] if index < total else None)
        inputs = torch.stack([r[:-1] if r is not None else torch.zeros(width - 1, dtype=torch.long) for r in rows])
        labels = torch.stack([r[1:] if r is not None else torch.full((width - 1,), IGNORE) for r in rows])
        yield inputs, labels


def num_windows(windows: int, local_batch_size: int, steps: int, dp_degree: int) -> int:
    """How many of `windows` validation windows an evaluation reads."""
    return windows if steps == -1 else min(windows, steps * local_batch_size * dp_degree)


@dataclass(frozen=True)
class EvalBatches:
    """Which validation windows this rank reads: rows dp_rank*local .. of each global batch of local x dp
    windows, for `steps` batches (-1: every window once)."""

    local_batch_size: int
    steps: int = -1
    dp_rank: int = 0
    dp_degree: int = 1

    def of(self, windows) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return eval_batches(windows, self.local_batch_size, self.steps, self.dp_rank, self.dp_degree)


def validation_sets(windows) -> list[tuple[str | None, object]]:
    """(name, windows) of each validation set: the parts of windows from several named sources, else (None, all)."""
    names = getattr(windows, "names", None)
    if names and len(names) > 1:
        return list(zip(names, windows.parts))
    return [(None, windows)]


def set_sizes(windows) -> list[tuple[str, int]] | None:
    """(name, windows) of each validation set where there are several (None: one), for the start-up's line."""
    sets = validation_sets(windows)
    return [(name, len(part)) for name, part in sets if name is not None] or None  # type: ignore[arg-type]


class Validator:
    """Evaluates this rank's model parts on the validation windows; every rank returns the global figures.
    The loss function is the training one (the token mean over non-ignored labels)."""

    def __init__(self, model: RankModel, windows, batches: EvalBatches):
        self.model, self.windows, self.batches = model, windows, batches
        self.device, self.pipeline = model.device, model.pipeline

    @torch.no_grad()
    def run(self) -> dict:
        start = time.perf_counter()
        for part in self.model.parts:
            part.eval()
        sets = validation_sets(self.windows)
        totals = torch.zeros(len(sets), 2, dtype=torch.float64, device=self.device)  # summed loss, target tokens
        try:
            for k, (_, windows) in enumerate(sets):
                for inputs, labels in self.batches.of(windows):
                    self.model.new_graph_round()  # compile.mode 'reduce-overhead': a new round of replays
                    inputs = inputs.to(self.device, non_blocking=True)
                    labels = labels.to(self.device, non_blocking=True)
                    totals[k] += self.pipelined_totals(inputs, labels) if self.pipeline else self.totals(inputs, labels)
        finally:
            for part in self.model.parts:
                part.train()
        if self.pipeline is not None:  # only the last stage has losses
            dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=self.pipeline.group)
        if self.model.loss_group is not None:
            dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=self.model.loss_group)
        loss_sum, tokens = totals.sum(dim=0).tolist()
        loss = loss_sum / tokens
        result = {
            "val_loss": loss,
            "val_perplexity": math.exp(loss) if loss < 700 else math.inf,
            "val_tokens": int(tokens),
            "val_seconds": round(time.perf_counter() - start, 3),
        }
        for (name, _), (set_sum, set_tokens) in zip(sets, totals.tolist()):
            if name is not None:
                result[f"val_loss/{name}"] = set_sum / set_tokens
        return result

    def totals(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The training loss function's token mean times the batch's target count: its sum (a batch of
        padding only, whose mean is 0/0, counts nothing)."""
        output, labels = self.model.forward(inputs, labels)
        with self.model.autocast(), self.model.loss_context():
            mean = local_value(self.model.loss_fn(output, labels)).double()
        count = (labels != IGNORE).sum().double()
        return torch.stack([torch.where(count > 0, mean * count, 0.0), count])

    def pipelined_totals(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Forward only through the schedule (its eval path). Its loss function gives each micro-batch's
        token mean; times the micro-batch's target count, that is its sum (padding-only micro-batches,
        whose mean is 0/0, count nothing)."""
        p = self.pipeline
        assert p is not None  # called only under pipeline parallelism
        inputs, labels, sequence = self.model.pipeline_split(inputs, labels)
        losses: list[torch.Tensor] = []
        with self.model.autocast(), self.model.loss_context():
            p.run(p.schedule.eval, inputs, labels, losses, sequence)
        if not p.has_last:
            return torch.zeros(2, dtype=torch.float64, device=self.device)
        counts = [(chunk != IGNORE).sum().double() for chunk in labels.tensor_split(len(losses))]
        sums = [torch.where(n > 0, local_value(loss).double() * n, 0.0) for loss, n in zip(losses, counts)]
        return torch.stack([torch.stack(sums).sum(), torch.stack(counts).sum()])
