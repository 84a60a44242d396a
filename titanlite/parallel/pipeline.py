"""Pipeline parallelism: cut the model into stages and run a `torch.distributed.pipelining` schedule.

Looped schedules put stages r, r+pp, r+2pp, ... on pp rank r; the V-shaped ones (ZBVZeroBubble,
DualPipeV) put stages r and 2pp-1-r on it, so the first and the last stage share rank 0.
"""

from __future__ import annotations

import copy
import functools
import itertools
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle, get_schedule_class
from torch.distributed.tensor import DTensor

from titanlite.base.errors import ConfigError
from titanlite.components.torch_private import pipeline_schedule_from_csv
from titanlite.config import Parallelism
from titanlite.models.common.attention import Sequence
from titanlite.models.common.interface import DecoderModule, unwrapped
from titanlite.models.registry import spec_of
from titanlite.parallel.dims import ParallelDims

SINGLE_STAGE = ("GPipe", "1F1B")
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
# torch 2.11 starts a V-shaped schedule by exchanging shapes point to point between every pair of adjacent
# stages, the two on one rank included, which gloo refuses ("Pair is not connected"); 2.13 runs them.
V_SHAPED_RUN = torch.__version__ >= "2.12"


@dataclass(frozen=True)
class PipelinePlan:
    pp: int
    schedule: str  # a schedule name, or "csv" for pipeline_parallel_schedule_csv
    layer_ranges: tuple[tuple[int, int], ...]  # [first, end) transformer layers of each stage
    n_microbatches: int

    @property
    def num_stages(self) -> int:
        return len(self.layer_ranges)

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // self.pp

    def stage_ids(self, pp_rank: int) -> tuple[int, ...]:
        if self.schedule in V_SHAPED:
            return (pp_rank, 2 * self.pp - 1 - pp_rank)
        return tuple(pp_rank + i * self.pp for i in range(self.stages_per_rank))

    def describe(self) -> str:
        def stage(i: int, first: int, end: int) -> str:
            extra = (" + embeddings" if i == 0 else "") + (" + norm, output" if i == self.num_stages - 1 else "")
            return f"stage {i}: layers {first}-{end - 1}{extra}"

        return "; ".join(stage(i, *r) for i, r in enumerate(self.layer_ranges))

    def analytic_bubble(self) -> float | None:
        """Idle time relative to compute: (p - 1) / m for GPipe and 1F1B, (p - 1) / (v m) for the looped
        schedules with v stages per rank. Zero-bubble schedules fill the bubble with weight-gradient work,
        so no single formula applies to them (None)."""
        if self.schedule in SINGLE_STAGE:
            return (self.pp - 1) / self.n_microbatches
        if self.schedule in ("Interleaved1F1B", "LoopedBFS"):
            return (self.pp - 1) / (self.stages_per_rank * self.n_microbatches)
        return None


def plan_pipeline(cfg: Parallelism, n_layers: int, samples_per_step: int) -> PipelinePlan | None:
    """Stages, layer split and micro-batch count for this config; ConfigError where they cannot work.

    samples_per_step: sequences one data-parallel rank processes per optimizer step (local batch x
    accumulation); the schedule cuts them into micro-batches.
    """
    pp = cfg.pipeline_parallel_degree
    if pp == 1:
        return None
    csv = cfg.pipeline_parallel_schedule_csv
    if csv and not Path(csv).is_file():
        raise ConfigError(f"parallelism.pipeline_parallel_schedule_csv='{csv}' does not exist")
    name = "csv" if csv else cfg.pipeline_parallel_schedule
    per_rank_default = 1 if name in SINGLE_STAGE else 2
    lps = cfg.pipeline_parallel_layers_per_stage
    num_stages = math.ceil(n_layers / lps) if lps else pp * per_rank_default
    if num_stages % pp:
        raise ConfigError(
            f"pipeline_parallel_layers_per_stage={lps} gives {num_stages} stages for {n_layers} layers, not a "
            f"multiple of pipeline_parallel_degree={pp}; choose layers_per_stage so that the stage count is one"
        )
    if name in SINGLE_STAGE and num_stages != pp:
        raise ConfigError(
            f"pipeline_parallel_schedule={name} runs one stage per rank, but the split gives {num_stages} stages "
            f"for pp={pp}; set pipeline_parallel_layers_per_stage = 0 or {math.ceil(n_layers / pp)}, or use a looped "
            "schedule"
        )
    if name in V_SHAPED and num_stages != 2 * pp:
        raise ConfigError(
            f"pipeline_parallel_schedule={name} runs exactly two stages per rank ({2 * pp} stages), but the split "
            f"gives {num_stages}; set pipeline_parallel_layers_per_stage = 0"
        )
    if n_layers < num_stages:
        raise ConfigError(f"{n_layers} layers cannot fill {num_stages} pipeline stages; use fewer stages")
    ranges = fixed_split(n_layers, lps) if lps else even_split(n_layers, num_stages)
    mb = cfg.pipeline_parallel_microbatch_size
    if samples_per_step % mb:
        raise ConfigError(
            f"pipeline_parallel_microbatch_size={mb} does not divide the {samples_per_step} sequences each "
            f"pipeline reads per step (local_batch_size x accumulation)"
        )
    m = samples_per_step // mb
    need = "at least" if name in SINGLE_STAGE else "a multiple of"
    if m < pp or (name not in SINGLE_STAGE and m % pp):
        raise ConfigError(
            f"the pipeline gets {m} micro-batch(es) per step ({samples_per_step} sequences / microbatch_size {mb}); "
            f"{name} on pipeline_parallel_degree={pp} needs {need} {pp}: raise training.local_batch_size or "
            f"lower pipeline_parallel_microbatch_size"
        )
    if name in V_SHAPED and not V_SHAPED_RUN:
        raise ConfigError(
            f"pipeline_parallel_schedule={name} needs torch 2.12 or later: torch {torch.__version__}'s pipelining "
            "sends between the two stages of one rank point to point, which fails; use Interleaved1F1B or "
            "InterleavedZeroBubble, or upgrade torch"
        )
    return PipelinePlan(pp=pp, schedule=name, layer_ranges=tuple(ranges), n_microbatches=m)


def check_pp_degree(pp: int, args) -> None:
    """Refuse pipeline stages for a model its family cannot cut into them (its spec's pp_refusal)."""
    why = spec_of(args).pp_refusal(args) if pp > 1 else None
    if why:
        raise ConfigError(f"parallelism.pipeline_parallel_degree={pp} cannot cut the {why}; use 1")


def check_pipeline_data_parallel(dims: ParallelDims) -> None:
    """Pipeline parallelism with DDP (replicas, nothing sharded) is refused before launch. torch's schedules
    drive a DDP-wrapped stage's gradient reducer by hand (no_sync, then prepare_for_backward before the last
    micro-batch's backward), and on torch 2.13 that fails. Measured with GPT-2 debug on PP 2 x DDP 2: GPipe,
    1F1B with 2 micro-batches, Interleaved1F1B and InterleavedZeroBubble stop at step 2 inside the reducer
    ("rebuilt parameter indices size is not same as original model parameters size"); only 1F1B with 4
    micro-batches ran (and matched one process). DDP's other modes do no better: with find_unused_parameters
    GPipe, 1F1B and Interleaved1F1B fail ("Expected to mark a variable ready only once") and
    InterleavedZeroBubble trains with wrong gradients (losses up to 1.5e-3 off in 5 steps: a zero-bubble schedule
    assigns weight gradients, which DDP's hooks never see); with static_graph, a 2-layer-per-stage toy model's
    replicas end with different gradients. FSDP is driven by the schedules through its own API and matches one
    process (tests/distributed/test_pipeline.py)."""
    if dims.pp_enabled and dims.ddp_enabled:
        raise ConfigError(
            f"parallelism.pipeline_parallel_degree={dims.pp} with DDP (data_parallel_replicate_degree="
            f"{dims.dp_replicate}, data_parallel_shard_degree=1) fails inside torch's pipeline schedules, which "
            f"drive DDP's gradient reducer wrongly; use FSDP beside PP: data_parallel_shard_degree={dims.dp_replicate} "
            "and data_parallel_replicate_degree=1"
        )


def even_split(n_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """As even as possible; when it cannot be even the earlier stages take one layer more (the last
    stage already carries the output projection)."""
    base, extra = divmod(n_layers, num_stages)
    sizes = [base + (i < extra) for i in range(num_stages)]
    starts = list(itertools.accumulate([0, *sizes]))
    return list(zip(starts[:-1], starts[1:]))


def fixed_split(n_layers: int, layers_per_stage: int) -> list[tuple[int, int]]:
    return [(first, min(first + layers_per_stage, n_layers)) for first in range(0, n_layers, layers_per_stage)]


def split_model(model: DecoderModule, plan: PipelinePlan, pp_rank: int) -> list[DecoderModule]:
    """One module per local stage: a copy of the (meta) model without the parts the stage does not own.

    Copying and deleting keeps parameter names as in the whole model, so weights initialise and
    checkpoint identically with or without pipeline parallelism. Multi-token prediction's depths (their blocks,
    layers past the decoder's, and `mtp`) go with the head on the last stage, which keeps a copy of the token
    embedding for them (TiedEmbeddingSync keeps it equal to the first stage's).
    """
    parts = []
    for stage in plan.stage_ids(pp_rank):
        first, end = plan.layer_ranges[stage]
        last = stage == plan.num_stages - 1
        part = copy.deepcopy(model)
        for key in list(part.layers):
            if not (first <= int(key) < end or last and int(key) >= end):
                del part.layers[key]
        ahead = last and ahead_of(part)
        if stage != 0:
            for name in part.first_stage_modules:
                if not (ahead and name == "tok_embeddings"):
                    setattr(part, name, None)
            part.embeds_input = False
        if not last:
            for name in (*part.last_stage_modules, *(("mtp",) if ahead_of(part) else ())):
                setattr(part, name, None)
        parts.append(part)
    return parts


def ahead_of(part: nn.Module) -> bool:
    """Whether the model has multi-token prediction's depths (models/common/multi_token.py), which go with its head."""
    return getattr(part, "mtp", None) is not None


def sequence_from_keywords(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A stage part's forward pre-hook: the schedule cuts keyword tensors into micro-batches along dim 0
    and hands them to every stage, so the batch's Sequence (context parallelism, block-causal masks)
    travels in its batch-major form (Sequence.batch_major) and is rebuilt here, for the part's forward."""
    fields = {name: kwargs.pop(name) for name in Sequence.TENSORS if name in kwargs}
    if fields:
        kwargs["sequence"] = Sequence.from_batch_major(**fields)
    return args, kwargs


def carry_as_keyword(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A stage part's forward pre-hook: the schedule hands a part the previous part's outputs positionally, so
    where a family's part returns (h, carry) (models/common/interface.py WithCarry; MoE families: the pooled routing
    totals, for the one load-balancing term the last stage adds), the carry goes to the next part's forward as the
    keyword `carry`, an argument like any other."""
    if len(args) == 2:
        h, carry = args
        return (h,), {**kwargs, "carry": carry}
    return args, kwargs


def logits_keyword(logits: bool, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A stage part's forward pre-hook: what the last part returns (`logits`; False: hidden states, for the
    chunked loss), given here rather than through the schedule, whose split backward on torch 2.11 takes every
    keyword value of a stage for a tensor."""
    return args, {**kwargs, "logits": logits}


def build_schedule(
    parts: list[nn.Module], plan: PipelinePlan, pp_group, pp_rank: int, device, loss_fn, csv: str, logits: bool
) -> tuple[PipelineScheduleSingle | PipelineScheduleMulti, list[PipelineStage]]:
    """The schedule over this rank's stages. Each stage takes the batch's Sequence, when there is one, as
    keyword tensors (sequence_from_keywords), the previous part's carry, when it returns one, as a keyword
    (carry_as_keyword), and `logits` (logits_keyword); the stage module stays the part itself, so the schedule
    still drives FSDP's and DDP's gradient sync."""
    for part in parts:
        part.register_forward_pre_hook(sequence_from_keywords, with_kwargs=True)
        part.register_forward_pre_hook(carry_as_keyword, with_kwargs=True)
        part.register_forward_pre_hook(functools.partial(logits_keyword, logits), with_kwargs=True)
    stages: list[PipelineStage] = [
        TimedStage(part, stage, plan.num_stages, device, group=pp_group)
        for part, stage in zip(parts, plan.stage_ids(pp_rank))
    ]
    # scale_grads: each micro-batch's loss is its own token mean, so the summed gradients are divided
    # by the micro-batch count, giving the gradient of the mean over the whole local batch.
    if plan.schedule == "csv":
        return pipeline_schedule_from_csv(stages, plan.n_microbatches, loss_fn, scale_grads=True, path=csv), stages
    cls = get_schedule_class(plan.schedule)
    if issubclass(cls, PipelineScheduleSingle):
        schedule = cls(stages[0], n_microbatches=plan.n_microbatches, loss_fn=loss_fn, scale_grads=True)
    else:
        schedule = cls(stages, n_microbatches=plan.n_microbatches, loss_fn=loss_fn, scale_grads=True)
    return schedule, stages


class TiedEmbeddingSync:
    """Keeps the copies of the embedding one: a tied embedding whose two uses live on different stages, and the
    last stage's copy that multi-token prediction's depths embed the tokens ahead with (split_model).

    The first stage holds the token embedding and the last the output projection or its own embedding (or both, the
    same tensor when tied): copies of one [vocab, dim] matrix. They start equal (each is seeded by the embedding's
    name, or read from the same Hugging Face tensor) and stay equal: before each optimizer step their gradients are
    summed, which is the shared parameter's gradient, so every copy takes the same AdamW update. Megatron keeps its
    embedding group in sync the same way.
    """

    def __init__(self, parts: list[nn.Module], plan: PipelinePlan, root_mesh, pp_rank: int):
        models = [unwrapped(p) for p in parts]  # the stage modules inside any DDP wrapper
        self.copies: list[torch.Tensor] = []  # this rank's, the first stage's first where it holds that stage
        for m in models:
            tied_head = m.output if m.args.tie_embeddings else None
            for module in (m.tok_embeddings, tied_head):
                if module is not None and not any(module.weight is c for c in self.copies):
                    self.copies.append(module.weight)
        self.has_first = 0 in plan.stage_ids(pp_rank)
        self.has_both = self.has_first and plan.num_stages - 1 in plan.stage_ids(pp_rank)  # V-shaped rank 0
        self.group = None
        # Group creation is collective: every rank creates every first/last pair, keeping its own.
        mesh = root_mesh.mesh  # ranks, pp outermost
        for coords in itertools.product(*(range(n) for n in mesh.shape[1:])):
            first, last = (0, *coords), (plan.pp - 1, *coords)  # not mesh[(0, *coords)]: mypy reads it as 3.11 syntax
            pair = sorted({int(mesh[first]), int(mesh[last])})
            group = dist.new_group(pair) if len(pair) == 2 else None
            if dist.get_rank() in pair:
                self.group = group

    @property
    def duplicates(self) -> list[torch.Tensor]:
        """The copies to leave out of the gradient norm (their gradients equal the first stage's embedding's)."""
        return self.copies[1:] if self.has_first else self.copies

    @torch.no_grad()
    def __call__(self) -> None:
        if not self.copies:
            return
        grads = []
        for copy_ in self.copies:
            assert copy_.grad is not None  # after backward
            grads.append(copy_.grad)
        if len(grads) > 1:  # several on this rank (V-shaped: the first and the last stage)
            total = functools.reduce(torch.add, grads)
            for g in grads:
                g.copy_(total)
        if self.group is not None and not self.has_both:  # the first and the last stage on two ranks
            grad = grads[0].to_local() if isinstance(grads[0], DTensor) else grads[0]
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=self.group)


class StageTimer:
    """Busy time of this rank's stages (forward, backward and weight-gradient chunks), for the idle share: each
    TimedStage adds its chunks' time here while `enabled`.

    Time spent waiting for neighbouring stages happens in the schedule, outside these calls. On CUDA the
    timer synchronises, so it is switched on only for the steps that are logged.
    """

    def __init__(self, stages, device: torch.device):
        self.device, self.busy, self.enabled = device, 0.0, False
        for stage in stages:
            stage.timer = self

    def time(self, fn, *args, **kwargs):
        if not self.enabled:
            return fn(*args, **kwargs)
        self._sync()
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self._sync()
            self.busy += time.perf_counter() - start

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class TimedStage(PipelineStage):
    """torch's PipelineStage, its forward, backward and weight-gradient chunks timed by `timer` (a StageTimer
    sets itself there; None: untimed). A subclass, so nothing of torch's stage is replaced at run time."""

    timer: StageTimer | None = None

    def _timed(self, fn, *args, **kwargs):
        return fn(*args, **kwargs) if self.timer is None else self.timer.time(fn, *args, **kwargs)

    def forward_one_chunk(self, *args, **kwargs):
        return self._timed(super().forward_one_chunk, *args, **kwargs)

    def backward_one_chunk(self, *args, **kwargs):
        return self._timed(super().backward_one_chunk, *args, **kwargs)

    def backward_weight_one_chunk(self, *args, **kwargs):
        return self._timed(super().backward_weight_one_chunk, *args, **kwargs)


def tied_across_stages(model: nn.Module, plan: PipelinePlan | None) -> bool:
    return plan is not None and getattr(model.args, "tie_embeddings", False)
