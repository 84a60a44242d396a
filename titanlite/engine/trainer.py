"""The training loop, identical for every layout: fetch micro-batches, forward/backward, clip, step, log.

The loss of a step is the mean over every target token of the global batch, whatever the layout.

The host never waits for the device in a quiet step: the loss and gradient norm stay on the device and
are read (one transfer for all the steps since the last read) only where they are needed: on logging
steps, before a checkpoint, at the last step and before a preemption save. A non-finite step is found
there: the run stops naming it, before anything is saved, or with training.skip_nonfinite_steps (or the
spike guard, training.spike_factor, which also skips a step whose gradient norm is a spike) its update was
already skipped on the device (the fused AdamW's found_inf), and it is reported; more skipped steps in a row
than training.max_skipped_steps_in_row stop the run there.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel as tp_loss_parallel
from torch.nn.parallel import DistributedDataParallel

from titanlite.base.errors import NonFiniteLoss, Preempted, TooManySkippedSteps
from titanlite.base.failures import mark_progress
from titanlite.components.loss import cross_entropy
from titanlite.components.metrics import MetricsLogger, Throughput, peak_memory_gib, reset_peak_memory
from titanlite.components.optim import clip_grad_norm_
from titanlite.components.profiling import Profiler
from titanlite.components.resilience import Faults, SpikeGuard, StopOnSignal, set_train_timeout
from titanlite.models.common.auxiliary import AuxiliaryLosses, collecting, metric_key
from titanlite.models.common.multi_token import future_labels
from titanlite.parallel.pipeline import StageTimer, TiedEmbeddingSync

logger = logging.getLogger(__name__)


@dataclass
class StepRecord:
    """One step's values as the host reads them."""

    step: int
    loss: float
    grad_norm: float
    bad: bool  # skipped, where steps are skipped (else: not finite, which stops the run)
    median: float  # the spike guard's median norm before the step (NaN: no guard, or its window not yet full)


class StepRecords:
    """Each step's loss, grad norm, auxiliary loss terms and skip verdict kept on the device until the host needs
    them, then read at once."""

    def __init__(self):
        self.pending: list[tuple[int, torch.Tensor]] = []
        self.last_auxiliary: list[float] = []  # the auxiliary terms of the last step read, in the family's order

    def add(
        self,
        step: int,
        loss: torch.Tensor,
        grad_norm: torch.Tensor,
        auxiliary: torch.Tensor | None,
        guard: SpikeGuard,
    ) -> torch.Tensor:
        """Keep the step's values on the loss's device (under CPU offload the norm is computed on the host);
        returns the guard's verdict: whether the step is bad (a bool device scalar)."""
        values = [loss.detach().float(), grad_norm.detach().float().to(loss.device, non_blocking=True)]
        if auxiliary is not None:
            values += list(auxiliary.detach().float().to(loss.device))
        row = torch.stack(values)
        bad, median = guard.decide(row, values[1])
        self.pending.append((step, torch.cat([row[:2], bad.float().reshape(1), median.reshape(1), row[2:]])))
        return bad

    def read(self) -> list[StepRecord]:
        """Every step since the last read: the one place the host waits."""
        if not self.pending:
            return []
        steps = [step for step, _ in self.pending]
        values = torch.stack([v for _, v in self.pending]).tolist()
        self.pending = []
        self.last_auxiliary = values[-1][4:]
        return [StepRecord(step, row[0], row[1], row[2] > 0, row[3]) for step, row in zip(steps, values)]


@dataclass
class StepFigures:
    """What the trainer needs to turn step times into throughput, FLOPs and MFU figures."""

    tokens_per_step: int  # global: global_batch_size x seq_len
    world_size: int
    flops_per_token: float
    peak_tflops: float | None
    warmup_steps: int = 0  # the first steps, left out of tokens/s (metrics.throughput_warmup_steps)


@dataclass
class StepSettings:
    """How each step runs, and on which steps the trainer logs and evaluates."""

    grad_accum_steps: int = 1  # micro-batches per step on each rank
    max_norm: float = 0.0  # gradient clipping (0: none; the norm is logged either way)
    log_freq: int = 1
    val_freq: int = 0  # evaluate every val_freq steps (and at the last) when there is a validator


@dataclass
class Resilience:
    """What the loop needs to survive the cluster (titanlite/components/resilience.py)."""

    stop: StopOnSignal | None = None
    faults: Faults | None = None
    skip_bad_steps: bool = False  # a bad step's update is skipped (training.skip_nonfinite_steps or the spike guard)
    train_timeout_seconds: float = 0.0
    spike_factor: float = 0.0  # training.spike_factor (0: no spike guard)
    spike_window: int = 20
    max_skipped_steps_in_row: int = 5

    def loss_scale(self, step: int) -> float:
        return self.faults.loss_scale(step) if self.faults is not None else 1.0

    def drops(self, step: int) -> bool:
        return self.faults is not None and self.faults.drops(step)

    def grad_scale(self, step: int) -> float:
        return self.faults.grad_scale(step) if self.faults is not None else 1.0


class StageLoss:
    """The loss function a pipeline schedule holds (fixed when the schedule is built): the run's, or for the length of
    a `replaced` block another one the last stage applies to each micro-batch's output (the Scorer's token scores)."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, output, labels):
        return self.fn(output, labels)

    @contextlib.contextmanager
    def replaced(self, fn: Callable):
        kept, self.fn = self.fn, fn
        try:
            yield
        finally:
            self.fn = kept


@dataclass
class Pipeline:
    """This rank's share of a pipeline: the schedule and what it needs around each step."""

    schedule: PipelineScheduleSingle | PipelineScheduleMulti
    loss: StageLoss  # the loss function the schedule holds
    has_first: bool  # this rank feeds the inputs
    has_last: bool  # this rank computes the loss
    group: dist.ProcessGroup  # the pp process group
    timer: StageTimer
    tied_sync: TiedEmbeddingSync | None  # when a tied embedding spans stages, or MTP's embedding copy
    analytic_bubble: float | None
    microbatches: int = 1  # pipeline micro-batches per step

    def run(self, schedule_call, inputs: torch.Tensor, labels: torch.Tensor, losses: list, sequence: dict) -> None:
        """One schedule step (`schedule_call`: schedule.step, or schedule.eval for forward only): the first
        stage feeds the inputs, the last computes each micro-batch's loss into `losses`; every stage takes
        `sequence` (RankModel.pipeline_split), cut into the same micro-batches (what the last stage returns is
        set on the stages, parallel/pipeline.py's logits_keyword)."""
        args = (inputs,) if self.has_first else ()
        if self.has_last:
            # return_outputs=False: the last stage would otherwise keep every micro-batch's logits
            # until the step ends, only to return them merged.
            schedule_call(*args, target=labels, losses=losses, return_outputs=False, **sequence)
        else:
            schedule_call(*args, **sequence)


@dataclass
class RankModel:
    """This rank's share of the model, parallelised, and how a forward pass and its loss run on it: the same
    for training (Trainer) and evaluation (Validator)."""

    parts: list[nn.Module]  # one, or one per local pipeline stage
    device: torch.device
    loss_fn: Callable = cross_entropy  # the token mean of one micro-batch (titanlite/components/loss.py)
    # What the model returns for loss_fn: logits, or (False) its final hidden states, which the chunked loss takes
    # with the model's head.
    logits: bool = True
    # Under loss parallelism the logits arrive sharded by vocabulary; both the cross-entropy and its
    # backward must run inside torch's loss_parallel context.
    loss_parallel: bool = False
    autocast: Callable = contextlib.nullcontext  # bf16 autocast where FSDP does not already cast
    pipeline: Pipeline | None = None
    loss_group: dist.ProcessGroup | None = None  # the process group the loss is averaged over (dp x cp), or None
    # Called in order around each optimizer step (after clipping), with the step number being completed: e.g.
    # float8's scales for the next all-gather run after it.
    before_optimizer_step: list[Callable[[int], None]] = field(default_factory=list)
    after_optimizer_step: list[Callable[[int], None]] = field(default_factory=list)
    auxiliary_losses: tuple[str, ...] = ()  # the names of the model's auxiliary loss terms (its spec's)
    # A model with MoE blocks: the last step's expert load (max / mean tokens per expert of the worst block, a
    # device scalar), which one of the after_optimizer_step hooks computes.
    expert_load: Callable[[], torch.Tensor | None] | None = None
    # This rank's share of each batch's sequences and how attention sees them (context parallelism,
    # block-causal masks): (inputs, labels) -> (inputs, labels, Sequence or None).
    split: Callable | None = None
    # compile.mode 'reduce-overhead': compiled blocks replay CUDA graphs, and each forward starts a new round of
    # replays (torch.compiler.cudagraph_mark_step_begin). Only then: that call imports all of inductor (seconds).
    cuda_graphs: bool = False
    # Multi-token prediction depths (models/common/multi_token.py). In training (grad enabled) the labels become the
    # tokens 1..D + 1 places ahead, made over the whole window before the context-parallel split, and the model gets
    # the tokens 1..D ahead (mtp_tokens); evaluation runs the main model alone (loss_fn then takes plain labels).
    mtp_layers: int = 0
    # Whether a pipeline stage after the first reads the input's token ids (Decoder.reads_token_ids: hash-routed
    # experts): every stage then takes them as the keyword `token_ids`, cut into the micro-batches as the rest.
    token_ids: bool = False

    def ahead(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """`split` with multi-token prediction's labels: this rank's inputs, labels and Sequence (or None)."""
        if self.mtp_layers and torch.is_grad_enabled():
            labels = future_labels(labels, self.mtp_layers)
        if self.split is None:
            return inputs, labels, None
        return self.split(inputs, labels)

    def mtp_keywords(self, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model's keyword for the tokens ahead, where `labels` are multi-token prediction's (ahead)."""
        return {"mtp_tokens": labels[..., : self.mtp_layers]} if labels.dim() == 3 else {}

    def new_graph_round(self) -> None:
        """Under CUDA graphs, let the next replays reuse the last round's buffers; otherwise nothing."""
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The output (logits, or hidden states for the chunked loss) of this rank's share of the batch, and
        the labels that go with it. For the single-part (not pipelined) model."""
        inputs, labels, sequence = self.ahead(inputs, labels)
        extra = ({} if sequence is None else {"sequence": sequence}) | self.mtp_keywords(labels)
        with self.autocast():
            return self.parts[0](inputs, logits=self.logits, **extra), labels

    def pipeline_split(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """`split` for a pipeline step over the whole local batch: this rank's inputs and labels, and the
        Sequence as the keyword tensors every stage takes (titanlite.parallel.pipeline.sequence_from_keywords)."""
        inputs, labels, sequence = self.ahead(inputs, labels)
        keywords = {} if sequence is None else sequence.batch_major(inputs.shape[0])
        keywords |= {"token_ids": inputs} if self.token_ids else {}
        return inputs, labels, keywords | self.mtp_keywords(labels)

    def loss_context(self):
        return tp_loss_parallel() if self.loss_parallel else contextlib.nullcontext()


class Trainer:
    """Trains this rank's model from its current (possibly resumed) step: the same loop for every layout."""

    def __init__(
        self,
        model: RankModel,
        optimizer,
        lr_scheduler,
        loader,
        *,
        settings: StepSettings,
        figures: StepFigures,
        logger: MetricsLogger,
        checkpointer=None,
        resilience: Resilience | None = None,
        validator=None,
        downstream=None,
    ):
        self.model, self.optimizer, self.lr_scheduler, self.loader = model, optimizer, lr_scheduler, loader
        self.model_parts, self.device, self.pipeline = model.parts, model.device, model.pipeline
        self.params = [p for part in model.parts for p in part.parameters() if p.requires_grad]
        duplicates = self.pipeline.tied_sync.duplicates if self.pipeline and self.pipeline.tied_sync else []
        self.norm_params = [p for p in self.params if not any(p is d for d in duplicates)]
        self.settings, self.figures, self.logger = settings, figures, logger
        self.throughput = Throughput(figures.warmup_steps)
        self.pipeline_idle = 0.0
        self.checkpointer = checkpointer
        self.resilience = resilience or Resilience()
        self.validator = validator  # titanlite.engine.validator.Validator, every settings.val_freq steps
        # titanlite.engine.downstream.InLoopScoring: lm-eval tasks every downstream.interval steps and at the last
        self.downstream = downstream
        self.profiler: Profiler | None = None  # stepped after every training step
        self.step = 0
        self.tokens_seen = 0
        self.records = StepRecords()
        self.auxiliary = AuxiliaryLosses(model.auxiliary_losses)
        if self.auxiliary.names:
            for part in model.parts:
                self.auxiliary.watch(part)
        self.expert_load: torch.Tensor | None = None  # the last step's (MoE models), read by log
        r = self.resilience
        self.guard = SpikeGuard(r.spike_factor, r.spike_window, self.device)
        self.skipped_steps: list[int] = []  # steps skipped since the last log
        self.skipped_total = 0
        self.skipped_in_row = 0
        # The guard's window as the host last read it (the device keeps its own): what a checkpoint saves.
        self.kept_norms: deque[float] = deque(maxlen=r.spike_window if r.spike_factor > 0 else 0)

    @property
    def train_state(self) -> dict:
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "elapsed_s": round(self.logger.elapsed(), 3),
            "skipped_total": self.skipped_total,
            "skipped_in_row": self.skipped_in_row,
            "kept_grad_norms": list(self.kept_norms),
        }

    def resume(self, train_state: dict) -> None:
        """Continue from a checkpoint's trainer state: the step, the tokens and the skip guard's counts and window."""
        self.step, self.tokens_seen = train_state["step"], train_state["tokens_seen"]
        self.skipped_total, self.skipped_in_row = train_state["skipped_total"], train_state["skipped_in_row"]
        self.kept_norms.extend(train_state["kept_grad_norms"])
        self.guard.load(list(self.kept_norms))

    def train(self, total_steps: int, stop_after_step: int = 0) -> None:
        """Run from the current (possibly resumed) step to `total_steps`, or stop after `stop_after_step`."""
        last = min(stop_after_step or total_steps, total_steps)
        batches = iter(self.loader)
        reset_peak_memory(self.device)
        first = True
        with self.profiler or contextlib.nullcontext():
            while self.step < last:
                if self.throughput.steps_seen == self.throughput.warmup_steps > 0:
                    synchronize(self.device)  # the counted steps start with no warm-up work still queued
                start = time.perf_counter()
                if self.resilience.drops(self.step + 1):
                    for _ in range(self.settings.grad_accum_steps):
                        next(batches)
                micro_batches = [next(batches) for _ in range(self.settings.grad_accum_steps)]
                self.throughput.add_data_wait(time.perf_counter() - start)
                mark_progress(self.step + 1)  # a peer that times out in this step's collectives can name a laggard
                lr = self.optimizer.param_groups[0]["lr"]
                will_eval = self.validator is not None and (
                    (self.step + 1) % self.settings.val_freq == 0 or self.step + 1 == last
                )
                will_score = self.downstream is not None and (
                    (self.step + 1) % self.downstream.interval == 0 or self.step + 1 == last
                )
                will_log = (
                    (self.step + 1) % self.settings.log_freq == 0 or self.step + 1 == last or will_eval or will_score
                )
                will_save = self.checkpointer is not None and self.checkpointer.due(self.step + 1)
                self.train_step(micro_batches, measure=will_log)
                self.step += 1
                self.tokens_seen += self.figures.tokens_per_step
                # A read waits for the device, inside this step's time: tokens/s stays the true rate.
                records = self.read_records() if will_log or will_save else []
                elapsed = time.perf_counter() - start
                self.throughput.add(self.figures.tokens_per_step, elapsed)
                # Evaluated after the step's time is taken: evaluation is not in the training tokens/s.
                validation = self.validator.run() if will_eval else {}
                if will_score:  # also after the step's time; with the random states as they were
                    validation |= self.downstream.run(self.step)
                if will_log:
                    self.log(records[-1].loss, records[-1].grad_norm, lr, last, validation)
                if self.checkpointer is not None:
                    self.checkpointer.maybe_save(self.step, self.train_state)
                self.after_step(first)
                first = False
                if self.profiler is not None:
                    self.profiler.step()
        if self.resilience.stop is not None:
            self.resilience.stop.finish()

    def read_records(self) -> list[StepRecord]:
        """The steps since the last read, from the device. A non-finite one stops the run here, naming
        it, before anything is saved; where steps are skipped (skip_nonfinite_steps, the spike guard) its
        update was skipped on the device and it is reported instead, and too many in a row stop the run."""
        records = self.records.read()
        r = self.resilience
        for record in records:
            if not record.bad:
                self.skipped_in_row = 0
                self.kept_norms.append(record.grad_norm)
                continue
            step, loss, norm = record.step, record.loss, record.grad_norm
            if not r.skip_bad_steps:
                raise NonFiniteLoss(f"loss {loss} / grad norm {norm} at step {step} is not finite")
            self.skipped_steps.append(step)
            self.skipped_total += 1
            self.skipped_in_row += 1
            if math.isfinite(loss) and math.isfinite(norm):
                reason = (
                    f"grad norm {norm:.4g} is over training.spike_factor {r.spike_factor:g} x the median "
                    f"{record.median:.4g} of the last {r.spike_window} kept steps' norms"
                )
            else:
                reason = f"loss {loss}, grad norm {norm}"
            logger.warning(f"titanlite: step {step}: {reason}; its update was skipped")
            if self.skipped_in_row > r.max_skipped_steps_in_row:
                raise TooManySkippedSteps(
                    f"steps {step - self.skipped_in_row + 1}-{step}: {self.skipped_in_row} updates in a row were "
                    f"skipped, more than training.max_skipped_steps_in_row={r.max_skipped_steps_in_row}"
                )
        return records

    def after_step(self, first: bool) -> None:
        """Fault hooks, the tighter collective timeout once start-up is over, and preemption."""
        r = self.resilience
        if r.faults is not None:
            r.faults.after_step(self.step)
        if first and r.train_timeout_seconds:
            set_train_timeout(r.train_timeout_seconds)
        signum = r.stop.requested() if r.stop is not None else 0
        if signum:
            self.read_records()  # never save the weights of a non-finite step
            saved = self.checkpointer is not None and self.checkpointer.maybe_save(
                self.step, self.train_state, force=True
            )
            raise Preempted(signum, self.step, saved)

    def train_step(self, micro_batches, measure: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step; returns the global loss and gradient norm as device tensors (not read)."""
        for part in self.model_parts:
            part.train()
        if self.pipeline is None:
            step_loss = self.forward_backward(micro_batches)
        else:
            step_loss = self.pipelined_forward_backward(micro_batches, measure)
            if self.pipeline.tied_sync is not None:
                self.pipeline.tied_sync()
        loss = self.reduce_loss(step_loss)
        if (spike := self.resilience.grad_scale(self.step + 1)) != 1.0:
            for p in self.params:  # a test fault (spike@STEP); one by one: DTensor's foreach takes one mesh
                if p.grad is not None:
                    p.grad.mul_(spike)
        grad_norm = clip_grad_norm_(
            self.params,
            self.settings.max_norm,
            norm_params=self.norm_params,
            pp_group=None if self.pipeline is None else self.pipeline.group,
        )
        auxiliary = None
        if self.auxiliary.names:
            passes = len(micro_batches) if self.pipeline is None else self.pipeline.microbatches
            auxiliary = self.reduce_loss(self.auxiliary.take(self.device, passes))
        bad = self.records.add(self.step + 1, loss, grad_norm, auxiliary, self.guard)
        if self.resilience.skip_bad_steps:
            # Every value is global (identical on every rank), so every rank skips the same steps.
            self.optimizer.skip_update_if(bad)
        for hook in self.model.before_optimizer_step:
            hook(self.step + 1)
        self.optimizer.step()
        for hook in self.model.after_optimizer_step:
            hook(self.step + 1)
        if self.model.expert_load is not None:
            self.expert_load = self.model.expert_load()  # on the device until a log reads it
        self.optimizer.zero_grad()
        self.lr_scheduler.step()
        return loss, grad_norm

    def forward_backward(self, micro_batches) -> torch.Tensor:
        model = self.model_parts[0]
        step_loss = torch.zeros((), device=self.device)
        for i, (inputs, labels) in enumerate(micro_batches):
            self.model.new_graph_round()  # each micro-batch, under compile.mode 'reduce-overhead'
            inputs = inputs.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            # Every window has exactly seq_len targets (seq_len / cp on each context-parallel rank), so each
            # micro-batch's token mean divided by the micro-batch count, then averaged over dp x cp ranks (DDP/FSDP
            # reduce by mean), is the mean over all target tokens of the global batch. Auxiliary terms alike.
            scale = self.resilience.loss_scale(self.step + 1) / len(micro_batches)
            self.auxiliary.grad_scale, self.auxiliary.value_weight = scale, 1 / len(micro_batches)
            with self.gradient_sync(model, last=i == len(micro_batches) - 1), collecting(self.auxiliary):
                output, labels = self.model.forward(inputs, labels)  # logits, or hidden states (components/loss.py)
                with self.model.autocast(), self.model.loss_context():  # the chunked loss's projection autocasts too
                    loss = self.model.loss_fn(output, labels) * scale
                    del output  # nothing in backward needs the full-vocabulary logits: free them now
                    loss.backward()
            step_loss += local_value(loss)
        return step_loss

    def pipelined_forward_backward(self, micro_batches, measure: bool) -> torch.Tensor:
        """One schedule step over this rank's whole share of the batch (the schedule cuts it into
        pipeline micro-batches; accumulation micro-batches simply join the same step)."""
        p = self.pipeline
        assert p is not None  # called only under pipeline parallelism
        inputs = torch.cat([x for x, _ in micro_batches]).to(self.device, non_blocking=True)
        labels = torch.cat([y for _, y in micro_batches]).to(self.device, non_blocking=True)
        inputs, labels, sequence = self.model.pipeline_split(inputs, labels)
        losses: list[torch.Tensor] = []
        p.timer.enabled, p.timer.busy = measure, 0.0
        start = time.perf_counter()
        # The schedule divides the summed gradients by the micro-batch count (scale_grads): auxiliary terms join
        # each micro-batch's loss unscaled.
        self.auxiliary.grad_scale, self.auxiliary.value_weight = 1.0, 1 / p.microbatches
        with self.model.autocast(), self.model.loss_context(), collecting(self.auxiliary):
            p.run(p.schedule.step, inputs, labels, losses, sequence)
        if measure:
            self.pipeline_idle = 1.0 - p.timer.busy / (time.perf_counter() - start)
        p.timer.enabled = False
        if not p.has_last:
            return torch.zeros((), device=self.device)
        return torch.stack([local_value(loss) for loss in losses]).mean() * self.resilience.loss_scale(self.step + 1)

    def reduce_loss(self, step_loss: torch.Tensor) -> torch.Tensor:
        """The global mean: from the last pipeline stage to every rank, then averaged over dp."""
        if self.pipeline is not None:
            dist.all_reduce(step_loss, op=dist.ReduceOp.SUM, group=self.pipeline.group)
        if self.model.loss_group is not None:
            # gloo has no AVG reduction: sum, then divide.
            dist.all_reduce(step_loss, op=dist.ReduceOp.SUM, group=self.model.loss_group)
            step_loss /= dist.get_world_size(self.model.loss_group)
        return step_loss

    @staticmethod
    def gradient_sync(model: nn.Module, last: bool):
        """Skip gradient communication on all but the last micro-batch of a step."""
        if isinstance(model, DistributedDataParallel):
            return contextlib.nullcontext() if last else model.no_sync()
        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def log(self, loss: float, grad_norm: float, lr: float, total_steps: int, validation: dict | None = None) -> None:
        total_tps = self.throughput.take()
        tps = None if total_tps is None else total_tps / self.figures.world_size
        tflops = None if tps is None else tps * self.figures.flops_per_token / 1e12
        peak = self.figures.peak_tflops
        mfu = None if tflops is None or peak is None else 100.0 * tflops / peak
        mem_peak, mem_reserved = peak_memory_gib(self.device)
        record: dict[str, Any] = {
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
            "data_wait_pct": self.throughput.take_data_wait_pct(),
        }
        record |= {metric_key(name): v for name, v in zip(self.auxiliary.names, self.records.last_auxiliary)}
        if self.expert_load is not None:
            record["expert_load"] = self.expert_load.item()
        if self.skipped_steps:
            record["skipped_steps"], self.skipped_steps = self.skipped_steps, []
        if self.resilience.skip_bad_steps:
            record["skipped_total"] = self.skipped_total
        record |= validation or {}
        if self.pipeline is not None:
            record |= self.bubble_figures()
        self.logger.log(record)

    def bubble_figures(self) -> dict:
        """The schedule's analytic bubble beside the measured idle share of each pp rank (a collective)."""
        assert self.pipeline is not None  # logged only under pipeline parallelism
        idle = torch.tensor([self.pipeline_idle], dtype=torch.float32, device=self.device)
        gathered = [torch.zeros_like(idle) for _ in range(dist.get_world_size(self.pipeline.group))]
        dist.all_gather(gathered, idle, group=self.pipeline.group)
        return {
            "pp_bubble_analytic": self.pipeline.analytic_bubble,
            "pp_idle_pct": [round(100.0 * t.item(), 1) for t in gathered],
        }


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def local_value(loss: torch.Tensor) -> torch.Tensor:
    """A detached plain tensor; under loss parallelism the loss is a replicated DTensor."""
    loss = loss.detach()
    return loss.to_local() if isinstance(loss, DTensor) else loss


def autocast_for(device: torch.device, model: nn.Module, param_dtype: torch.dtype):
    """bf16 autocast where FSDP's mixed-precision policy does not already cast (DDP, single device) on CUDA."""
    if device.type != "cuda" or param_dtype == torch.float32 or isinstance(model, FSDPModule):
        return contextlib.nullcontext
    return lambda: torch.autocast("cuda", dtype=param_dtype)
