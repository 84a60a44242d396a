"""The training loop, identical for every layout: fetch micro-batches, forward/backward, clip, step, log.

The loss of a step is the mean over every target token of the global batch, whatever the layout.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel as tp_loss_parallel
from torch.nn.parallel import DistributedDataParallel

from titanlite.metrics import MetricsLogger, Throughput, peak_memory_gib, reset_peak_memory
from titanlite.optim import clip_grad_norm_


@dataclass
class StepFigures:
    """What the trainer needs to turn step times into throughput, FLOPs and MFU figures."""

    tokens_per_step: int  # global: global_batch_size x seq_len
    world_size: int
    flops_per_token: float
    peak_tflops: float | None


class Trainer:
    def __init__(self, model, optimizer, lr_scheduler, loader, *, grad_accum_steps, max_norm, device, loss_group,
                 figures: StepFigures, logger: MetricsLogger, log_freq: int, throughput_warmup_steps: int, autocast,
                 loss_parallel: bool = False):
        self.model, self.optimizer, self.lr_scheduler, self.loader = model, optimizer, lr_scheduler, loader
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.grad_accum_steps, self.max_norm, self.device = grad_accum_steps, max_norm, device
        self.loss_group = loss_group  # process group the loss is averaged over (dp), or None
        self.figures, self.logger, self.log_freq = figures, logger, log_freq
        self.throughput = Throughput(throughput_warmup_steps)
        self.autocast = autocast
        # Under loss parallelism the logits arrive sharded by vocabulary; both the cross-entropy and its
        # backward must run inside this context.
        self.loss_context = tp_loss_parallel if loss_parallel else contextlib.nullcontext
        self.step = 0

    def train(self, total_steps: int) -> None:
        batches = iter(self.loader)
        reset_peak_memory(self.device)
        while self.step < total_steps:
            start = time.perf_counter()
            micro_batches = [next(batches) for _ in range(self.grad_accum_steps)]
            lr = self.optimizer.param_groups[0]["lr"]
            loss, grad_norm = self.train_step(micro_batches)
            self.step += 1
            elapsed = time.perf_counter() - start
            self.throughput.add(self.step, self.figures.tokens_per_step, elapsed)
            if self.step % self.log_freq == 0 or self.step == total_steps:
                self.log(loss, grad_norm, lr, total_steps)

    def train_step(self, micro_batches) -> tuple[float, float]:
        self.model.train()
        step_loss = torch.zeros((), device=self.device)
        for i, (inputs, labels) in enumerate(micro_batches):
            inputs = inputs.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            with self.gradient_sync(last=i == len(micro_batches) - 1):
                with self.autocast():
                    logits = self.model(inputs)
                with self.loss_context():
                    # Every window has exactly seq_len targets, so each micro-batch's token mean divided
                    # by the micro-batch count, then averaged over dp ranks (DDP/FSDP reduce by mean), is
                    # the mean over all target tokens of the global batch.
                    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()) / len(micro_batches)
                    loss.backward()
            # Under loss parallelism the loss is a replicated DTensor; its local value is the whole loss.
            step_loss += loss.detach().to_local() if isinstance(loss, DTensor) else loss.detach()
        grad_norm = clip_grad_norm_(self.params, self.max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        if self.loss_group is not None:
            # gloo has no AVG reduction: sum, then divide.
            dist.all_reduce(step_loss, op=dist.ReduceOp.SUM, group=self.loss_group)
            step_loss /= dist.get_world_size(self.loss_group)
        return step_loss.item(), grad_norm.item()

    def gradient_sync(self, last: bool):
        """Skip gradient communication on all but the last micro-batch of a step."""
        if isinstance(self.model, DistributedDataParallel):
            return contextlib.nullcontext() if last else self.model.no_sync()
        if isinstance(self.model, FSDPModule):
            self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def log(self, loss: float, grad_norm: float, lr: float, total_steps: int) -> None:
        total_tps = self.throughput.take()
        tps = None if total_tps is None else total_tps / self.figures.world_size
        tflops = None if tps is None else tps * self.figures.flops_per_token / 1e12
        peak = self.figures.peak_tflops
        mfu = None if tflops is None or peak is None else 100.0 * tflops / peak
        mem_peak, mem_reserved = peak_memory_gib(self.device)
        self.logger.log(
            {
                "step": self.step,
                "loss": loss,
                "grad_norm": grad_norm,
                "lr": lr,
                "tps": tps,
                "tflops": tflops,
                "mfu_pct": mfu,
                "mem_peak_gib": mem_peak,
                "mem_reserved_gib": mem_reserved,
                "eta_s": self.throughput.eta_seconds(total_steps - self.step),
            }
        )


def autocast_for(device: torch.device, model: nn.Module, param_dtype: torch.dtype):
    """bf16 autocast where FSDP's mixed-precision policy does not already cast (DDP, single device) on CUDA."""
    if device.type != "cuda" or param_dtype == torch.float32 or isinstance(model, FSDPModule):
        return contextlib.nullcontext
    return lambda: torch.autocast("cuda", dtype=param_dtype)
