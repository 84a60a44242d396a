"""Validation: the token-mean loss over fixed held-out windows, on any layout, and `titanlite eval`.

Every evaluation visits the same windows in corpus order (the whole validation split, or its first
`validation.steps` batches). The last batch is padded with ignored rows, so no window is dropped or
counted twice whatever the data-parallel degree. Evaluation runs without gradients, in eval mode,
reads no training data and draws no random numbers: a run with validation trains exactly as one without.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import loss_parallel as tp_loss_parallel

from titanlite.errors import ConfigError
from titanlite.loss import IGNORE, cross_entropy
from titanlite.trainer import local_value



def eval_batches(windows, local_batch_size: int, steps: int, dp_rank: int, dp_degree: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
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


class Validator:
    """Evaluates this rank's model parts on the validation windows; every rank returns the global figures."""

    def __init__(self, windows, *, local_batch_size: int, steps: int, dp_rank: int, dp_degree: int, device,
                 model_parts, loss_group=None, pipeline=None, loss_parallel: bool = False, autocast=contextlib.nullcontext,
                 loss_fn=None):
        self.windows, self.local_batch_size, self.steps = windows, local_batch_size, steps
        self.dp_rank, self.dp_degree, self.device = dp_rank, dp_degree, device
        self.model_parts, self.loss_group, self.pipeline = model_parts, loss_group, pipeline
        self.loss_context = tp_loss_parallel if loss_parallel else contextlib.nullcontext
        self.autocast = autocast
        self.loss_fn = loss_fn or cross_entropy  # the training loss (token mean over non-ignored labels)

    @torch.no_grad()
    def run(self) -> dict:
        start = time.perf_counter()
        for part in self.model_parts:
            part.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)  # summed loss, target tokens
        try:
            for inputs, labels in eval_batches(self.windows, self.local_batch_size, self.steps, self.dp_rank, self.dp_degree):
                inputs = inputs.to(self.device, non_blocking=True)
                labels = labels.to(self.device, non_blocking=True)
                totals += self.pipelined_totals(inputs, labels) if self.pipeline else self.totals(inputs, labels)
        finally:
            for part in self.model_parts:
                part.train()
        if self.pipeline is not None:  # only the last stage has losses
            dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=self.pipeline.group)
        if self.loss_group is not None:
            dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=self.loss_group)
        loss_sum, tokens = totals.tolist()
        loss = loss_sum / tokens
        return {
            "val_loss": loss,
            "val_perplexity": math.exp(loss) if loss < 700 else math.inf,
            "val_tokens": int(tokens),
            "val_seconds": round(time.perf_counter() - start, 3),
        }

    def totals(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The training loss function's token mean times the batch's target count: its sum (a batch of
        padding only, whose mean is 0/0, counts nothing)."""
        with self.autocast():
            output = self.model_parts[0](inputs)
        with self.autocast(), self.loss_context():
            mean = local_value(self.loss_fn(output, labels)).double()
        count = (labels != IGNORE).sum().double()
        return torch.stack([torch.where(count > 0, mean * count, 0.0), count])

    def pipelined_totals(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Forward only through the schedule (its eval path). Its loss function gives each micro-batch's
        token mean; times the micro-batch's target count, that is its sum (padding-only micro-batches,
        whose mean is 0/0, count nothing)."""
        p = self.pipeline
        losses: list[torch.Tensor] = []
        with self.autocast(), self.loss_context():
            p.run(p.schedule.eval, inputs, labels, losses)
        if not p.has_last:
            return torch.zeros(2, dtype=torch.float64, device=self.device)
        counts = [(chunk != IGNORE).sum().double() for chunk in labels.tensor_split(len(losses))]
        sums = [torch.where(n > 0, local_value(loss).double() * n, 0.0) for loss, n in zip(losses, counts)]
        return torch.stack([torch.stack(sums).sum(), torch.stack(counts).sum()])


# ----------------------------------------------------------------------------------------------
# titanlite eval


def eval_command(argv: list[str]) -> int:
    """`titanlite eval [--ngpu N] [--output F.json]`: checks everything it can in this process, then
    evaluates here (N = 1) or in N torchrun workers; rank 0 prints the result."""
    from titanlite.checkpoint import checkpoint_to_load
    from titanlite.config import parse_config
    from titanlite.devices import check_local_ranks
    from titanlite.tools import take_options
    from titanlite.train import build_data, build_validation_data, plan_run

    opts, rest = take_options(argv, {"ngpu": 1, "output": ""}, "eval")
    cfg = parse_config(rest)
    if opts["ngpu"] < 1:
        raise ConfigError(f"eval --ngpu {opts['ngpu']} must be at least 1")
    check_local_ranks(opts["ngpu"])
    plan_run(cfg, opts["ngpu"], validation=True)
    checkpoint_to_load(cfg, "evaluate")
    tokenizer, corpus = build_data(cfg, verify="sample", say=lambda line: print(line, flush=True))
    build_validation_data(cfg, tokenizer, corpus, verify="sample", say=lambda line: print(line, flush=True))
    env = {**os.environ, "TITANLITE_EVAL": "1", "TITANLITE_EVAL_OUTPUT": opts["output"]}
    if opts["ngpu"] == 1:  # no process group: the worker runs here and returns
        from titanlite.train import main as worker_main

        os.environ.update(env)
        return worker_main(rest)
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    cmd = [sys.executable, "-m", "titanlite.launch", "--standalone", f"--nproc-per-node={opts['ngpu']}",
           "-m", "titanlite.train", *rest]
    return subprocess.run(cmd, env=env).returncode


def report(result: dict, path: Path, say) -> None:
    """The worker side of `titanlite eval`, after the evaluation: print the figures; rank 0 saves them."""
    say(f"titanlite eval: {path}: val_loss {result['val_loss']:.4f}  val_perplexity {result['val_perplexity']:.2f}  "
        f"val_tokens {result['val_tokens']:,}  ({result['val_seconds']:.1f}s)")
    output = os.environ.get("TITANLITE_EVAL_OUTPUT", "")
    if output and (not dist.is_initialized() or dist.get_rank() == 0):
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps({**result, "checkpoint": str(path)}, indent=2) + "\n")
