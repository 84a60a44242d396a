"""Every piece of a training run on this rank, resumed from its newest checkpoint if there is one, in a
Trainer ready to train; and the start-up lines that say what runs."""

from __future__ import annotations

import json
import logging
import math
import os
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from titanlite.builder.data import build_data, build_loader, build_validation_data, describe_validation, dp_rank
from titanlite.builder.model import ModelSetup, build_rank_model, plain_model
from titanlite.builder.plan import ModelPlan, Plan, validation_batch_size
from titanlite.components.checkpoint import Checkpointer
from titanlite.components.loss import build_scores
from titanlite.components.metrics import MetricsLogger, count_params, device_peak_tflops, flops_per_token, read_records
from titanlite.components.optim import LRSchedulers, Optimizers, describe_muon, warmup_cut
from titanlite.components.profiling import Profiler
from titanlite.components.resilience import Faults, StopOnSignal
from titanlite.components.wandb_run import WandbRun
from titanlite.config import JobConfig, to_toml
from titanlite.engine.downstream import InLoopScoring, task_manager, titanlite_lm
from titanlite.engine.scorer import Scorer, ScoringShape, gathered_state
from titanlite.engine.trainer import Resilience, StepFigures, StepSettings, Trainer
from titanlite.engine.validator import EvalBatches, Validator, set_sizes
from titanlite.models.build import linear_backend
from titanlite.models.common.attention import CoreAttention, FlexAttention, SDPAttention
from titanlite.models.common.flops import active_parameters
from titanlite.models.common.gated_delta_net import DeltaRule
from titanlite.models.common.interface import unwrapped
from titanlite.models.common.latent.sparse import SparseLatentAttention
from titanlite.models.common.mamba2 import StateScan
from titanlite.models.common.moe.layer import (
    LOOP_CHOSEN,
    LOOP_COMPILED,
    LOOP_UNALIGNED,
    LOOP_UNSUPPORTED,
    GroupedExperts,
)
from titanlite.parallel.float8 import describe_float8

logger = logging.getLogger(__name__)


def describe_model(cfg: JobConfig) -> str:
    m = cfg.model
    return f"{m.name} {m.flavor}" + (f" (from {m.hf_assets_path})" if m.flavor == "hf" else "")


def build_validator(cfg: JobConfig, plan: Plan, setup: ModelSetup, mesh, windows) -> Validator:
    batches = EvalBatches(validation_batch_size(cfg), cfg.validation.steps, dp_rank(mesh), plan.dims.dp)
    return Validator(setup.rank, windows, batches)


def scoring_shape(cfg: JobConfig, plan: Plan) -> ScoringShape:
    """How the Scorer batches requests: downstream.batch_size rows per dp rank (the validation batch under PP), inputs
    of at most the validation window, a multiple of what CP and TP cut the sequence by, fixed under PP and compile."""
    rows = validation_batch_size(cfg) if plan.pipeline else cfg.downstream.batch_size or validation_batch_size(cfg)
    dims = plan.dims
    multiple = math.lcm(2 * dims.cp if dims.cp > 1 else 1, dims.tp)
    fixed = plan.pipeline is not None or cfg.compile.enable
    return ScoringShape(rows, cfg.validation.seq_len or cfg.training.seq_len, multiple, fixed)


def build_scorer(cfg: JobConfig, plan: Plan, setup: ModelSetup, mesh, device: torch.device) -> Scorer:
    """The Scorer of this rank's model: its loss's output scored at the targets, and for generation a whole copy of
    the model gathered from the layout when a task asks for one."""

    def whole_model():
        state = gathered_state(setup.rank.parts, mesh["pp"].get_group() if plan.pipeline else None)
        model = plain_model(cfg, plan.model)  # on the CPU, as `titanlite generate` builds it, then filled and moved
        model.load_state_dict(state)
        return model.to(device)

    scores = build_scores(setup.rank.parts, plan.loss.chunk_tokens)
    shape = scoring_shape(cfg, plan)
    return Scorer(setup.rank, scores, shape, dp_rank(mesh), plan.dims.dp, whole_model)


def build_downstream(cfg: JobConfig, plan: Plan, setup: ModelSetup, mesh, device: torch.device, rank: int):
    """[downstream]'s scoring during training, or None without tasks."""
    if not cfg.downstream.tasks:
        return None
    scorer = build_scorer(cfg, plan, setup, mesh, device)
    lm = titanlite_lm(scorer, plan.model.tokenizer, scorer.shape.max_len)
    return InLoopScoring(lm, cfg.downstream, task_manager(cfg.downstream), speaks=rank == 0)


def build_checkpointer(
    cfg: JobConfig, run_dir: Path, setup: ModelSetup, plan: Plan, optimizer, lr_scheduler, loader, facts: dict
) -> Checkpointer:
    parts = setup.rank.parts
    # Under PP a tied embedding's copy lives in the last stage's part as output.weight.
    tied_copy_parts = set()
    if plan.pipeline and setup.plain_model.args.tie_embeddings:
        models = [unwrapped(part) for part in parts]  # inside any DDP wrapper
        tied_copy_parts = {i for i, m in enumerate(models) if m.output is not None and m.tok_embeddings is None}
    return Checkpointer(
        cfg, run_dir, parts, optimizer, lr_scheduler, loader, tied_copy_parts=tied_copy_parts, facts=facts
    )


def run_facts(model: ModelPlan, corpus) -> dict:
    """What a checkpoint records beside the config, for a resume to be checked against: the planned model's shape,
    the tokenizer's fingerprint and the training corpus's window count (sources changed behind the same keys)."""
    facts = {"model": asdict(model.args), "tokenizer": model.tokenizer.fingerprint, "windows": len(corpus.windows)}
    return json.loads(json.dumps(facts))  # as a checkpoint's JSON gives them back (tuples become lists)


def keep_metrics_up_to(path: Path, step: int) -> None:
    """A fresh run starts a fresh record; a resumed one keeps the records up to the step it resumed from
    (later ones belong to the interrupted attempt and will be written again). Lines that are not whole records
    (a crash during a write tears the last one) are dropped with one line saying so. Rewritten atomically, so a
    crash here leaves the old file or the new one."""
    if not path.exists():
        return
    records, torn = read_records(path) if step else ([], [])
    if torn:
        lines = ", ".join(map(str, torn[:5])) + (f" and {len(torn) - 5} more" if len(torn) > 5 else "")
        logger.warning(
            f"titanlite: note: {path}: dropped {len(torn)} line(s) that are not whole records (line {lines}; "
            "a crash or a full disk during a write leaves a torn line); the whole ones are kept"
        )
    kept = [record for record in records if record["step"] <= step]
    write_atomically(path, "".join(json.dumps(record) + "\n" for record in kept))


def write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename: a crash leaves the old file or the new one,
    never half of either."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def build_trainer(cfg: JobConfig, plan: Plan, device: torch.device, rank: int, world_size: int) -> Trainer:
    """Every piece of a run, resumed from its newest checkpoint if there is one, in a Trainer ready to
    train (also what `titanlite bench throughput` measures)."""
    mesh = plan.dims.build_mesh(device.type)
    tokenizer = plan.model.tokenizer
    corpus = build_data(cfg, tokenizer)
    loader = build_loader(cfg, corpus, mesh, plan, device)
    setup = build_rank_model(cfg, plan, mesh, device)
    validator = None
    if cfg.validation.enable:
        validator = build_validator(cfg, plan, setup, mesh, build_validation_data(cfg, tokenizer, corpus))
    downstream = build_downstream(cfg, plan, setup, mesh, device, rank)
    optimizer = Optimizers(setup.rank.parts, cfg.optimizer, device.type, skip_nonfinite=cfg.training.skips_steps())
    lr_scheduler = LRSchedulers(optimizer, cfg.lr_scheduler, cfg.training.steps)

    run_dir = Path(cfg.job.dump_folder) / cfg.job.name
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
    facts = run_facts(plan.model, corpus)
    checkpointer = build_checkpointer(cfg, run_dir, setup, plan, optimizer, lr_scheduler, loader, facts)
    train_state: dict[str, Any] = {
        "step": 0,
        "tokens_seen": 0,
        "elapsed_s": 0.0,
        "skipped_total": 0,
        "skipped_in_row": 0,
        "kept_grad_norms": [],
    }
    checkpointer.load(train_state)
    if rank == 0:  # only once the load is accepted: a refused resume leaves the run folder as it was
        write_atomically(run_dir / "config.toml", to_toml(cfg))
        keep_metrics_up_to(run_dir / "metrics.jsonl", train_state["step"])
    peak = device_peak_tflops(device, cfg.metrics.peak_tflops)
    for line in startup_lines(cfg, plan, setup, corpus, validator, peak, device, world_size):
        logger.info(line)
    trainer = Trainer(
        setup.rank,
        optimizer,
        lr_scheduler,
        loader,
        settings=StepSettings(plan.grad_accum_steps, cfg.training.max_norm, cfg.metrics.log_freq, cfg.validation.freq),
        figures=StepFigures(
            tokens_per_step=plan.global_batch_size * cfg.training.seq_len,
            world_size=world_size,
            flops_per_token=flops_per_token(setup.plain_model, cfg.training.seq_len),
            peak_tflops=peak,
            warmup_steps=cfg.metrics.throughput_warmup_steps,
        ),
        logger=MetricsLogger(
            run_dir,
            cfg.metrics.enable_tensorboard,
            active=rank == 0,
            elapsed_before=train_state["elapsed_s"],
            wandb=start_wandb(cfg, run_dir, resumed=train_state["step"] > 0) if rank == 0 else None,
        ),
        checkpointer=checkpointer,
        validator=validator,
        downstream=downstream,
        resilience=Resilience(
            stop=StopOnSignal(device, saves=cfg.checkpoint.enable),
            faults=Faults(os.environ.get("TITANLITE_FAULT", ""), rank),
            skip_bad_steps=cfg.training.skips_steps(),
            train_timeout_seconds=cfg.comm.train_timeout_seconds,
            spike_factor=cfg.training.spike_factor,
            spike_window=cfg.training.spike_window,
            max_skipped_steps_in_row=cfg.training.max_skipped_steps_in_row,
        ),
    )
    trainer.resume(train_state)
    if cfg.profiling.enable_profiling:
        trainer.profiler = Profiler(cfg.profiling, run_dir, rank, device, lambda: trainer.step)
    return trainer


def start_wandb(cfg: JobConfig, run_dir: Path, resumed: bool) -> WandbRun | None:
    """Rank 0's W&B run when metrics.enable_wandb is on, with the resolved config; a resumed run continues the
    W&B run of the interrupted attempt."""
    if not cfg.metrics.enable_wandb:
        return None
    return WandbRun(run_dir, cfg.metrics, cfg.job.name, asdict(cfg), resumed)


def startup_lines(
    cfg: JobConfig, plan: Plan, setup: ModelSetup, corpus, validator, peak, device, world_size
) -> list[str]:
    """What rank 0 prints before the first step: the model, the layout, the data, the loss, validation,
    MFU, float8 and the pipeline."""
    n_params = count_params(setup.plain_model)
    lines = [
        f"titanlite: {' '.join(filter(None, [cfg.job.name, cfg.job.description]))} on "
        f"{', '.join(s.label for s in corpus.stores)}",
        f"  model {describe_model(cfg)}: {n_params:,} parameters ({n_params / 1e6:.1f} M), "
        f"{describe_active(setup.plain_model, n_params)}"
        f"vocab {setup.plain_model.args.vocab_size} (tokenizer {cfg.model.tokenizer}), seq_len {cfg.training.seq_len}, "
        f"dtype {str(setup.param_dtype).removeprefix('torch.')}",
        f"  layout: {plan.dims.describe()} on {world_size} {device.type} process(es); global batch "
        f"{plan.global_batch_size} = local {cfg.training.local_batch_size} x dp {plan.dims.dp} x accumulation "
        f"{plan.grad_accum_steps}; corpus {len(corpus.windows):,} windows of {cfg.training.seq_len + 1} tokens",
    ]
    lines += [f"  data: {line}" for line in corpus.describe(plan.global_batch_size * cfg.training.steps)]
    lines.append(setup.loss_line)
    lines.append(describe_attention(cfg, plan.dims.cp, setup.plain_model, device.type))
    if linear := describe_linear_attention(cfg, setup.plain_model, device.type):
        lines.append(linear)
    if experts := describe_experts(cfg, setup.plain_model, device, setup.param_dtype):
        lines.append(experts)
    if validator is not None:
        windows = validator.windows
        lines.append(f"  {describe_validation(cfg, corpus, len(windows), plan.dims.dp, sets=set_sizes(windows))}")
    if cfg.optimizer.name == "Muon":
        lines.append(describe_muon(setup.plain_model, cfg.optimizer, device.type))
    if cut := warmup_cut(cfg.lr_scheduler, cfg.training.steps):
        lines.append(cut)
    if skipping := describe_skipping(cfg.training):
        lines.append(skipping)
    if peak is None:
        lines.append(f"  MFU: no known peak for this {device.type} device; set metrics.peak_tflops to report it")
    if cfg.float8.enable:
        lines.append(describe_float8(cfg.float8, setup.rank.parts, device, plan.dims.fsdp_enabled))
    if plan.pipeline:
        pp = plan.pipeline
        lines.append(
            f"  pipeline: {pp.schedule}, {pp.num_stages} stages ({pp.stages_per_rank} per rank), "
            f"{pp.n_microbatches} micro-batches of {cfg.parallelism.pipeline_parallel_microbatch_size}; {pp.describe()}"
        )
    return lines


def describe_skipping(t) -> str | None:
    """The start-up line of the steps the run skips (training.skip_nonfinite_steps, the spike guard), or None."""
    if not t.skips_steps():
        return None
    what = "a step with a non-finite loss or gradient norm"
    if t.spike_factor > 0:
        what += (
            f", or whose gradient norm is over {t.spike_factor:g} x the median of the last {t.spike_window} kept "
            f"steps' (from step {t.spike_window + 1})"
        )
    return (
        f"  skipped steps: {what}, is skipped (no update; its data counts as consumed); more than "
        f"{t.max_skipped_steps_in_row} in a row stop the run"
    )


def attention_kernels(model: nn.Module, plain: bool, device_type: str, seq_len: int = 0) -> str:
    """What each layer's attention core runs, grouped: "sdpa's fused causal kernel in 4 of 6 layers, ..."; a sparse
    attention layer's own path where its indexer leaves keys out of sequences of `seq_len` tokens; a mixer with a
    `describe_kernel(seq_len)` says its own."""
    kinds: Counter[str] = Counter()
    for module in model.modules():
        describe = getattr(module, "describe_kernel", None)
        if describe is not None:  # a mixer that says its own path (DeepSeek-V4's compressed attention)
            kinds[describe(seq_len)] += 1
            continue
        core = getattr(module, "core", None)
        if not isinstance(core, CoreAttention):
            continue
        if isinstance(module, SparseLatentAttention) and not module.dense_warmup and module.indexer.topk < seq_len:
            kinds["PyTorch's gather of each query's selected keys, chunks of queries"] += 1
            continue
        extras = [f"window {core.window}"] if core.window else []
        extras += [f"logit softcap {core.softcap:g}"] if core.softcap else []
        extras += ["sinks"] if core.sinks else []
        if isinstance(core, FlexAttention):
            kernel = "FlexAttention, compiled" if device_type == "cuda" else "FlexAttention's blockwise CPU path"
        elif isinstance(core, SDPAttention):
            if core.softcap or core.sinks:
                kernel = "sdpa's explicit [B, H, T, S] scores"
            elif plain and not core.window:
                kernel = "sdpa's fused causal kernel"
            else:
                kernel = "sdpa with a dense T x S mask"
        else:
            kernel = type(core).__name__
        kinds[kernel + (f" ({', '.join(extras)})" if extras else "")] += 1
    total = sum(kinds.values())
    if len(kinds) == 1:
        return next(iter(kinds))
    return ", ".join(f"{kind} in {n} of {total} layers" for kind, n in kinds.items())


def describe_linear_attention(cfg: JobConfig, model: nn.Module, device_type: str) -> str | None:
    """Which kernel the linear-attention layers' gated delta rule and the Mamba-2 layers' scan run
    (model.linear_attn_backend, and why the PyTorch path where "auto" chose it; context parallelism hands each chunk
    its state, which only the PyTorch path takes); None for a model without such layers."""
    kinds = {"gated delta rule": DeltaRule, "SSD scan": StateScan}
    cores = [m for m in model.modules() if isinstance(m, (DeltaRule, StateScan))]
    # A layer's core once: context parallelism's wrapper is one too, and holds the layer's own as `inner`.
    wrapped = {id(inner) for m in cores if isinstance(inner := getattr(m, "inner", None), (DeltaRule, StateScan))}
    if not cores:
        return None
    layers = sum(1 for _ in unwrapped(model).layers)
    backend, why = linear_backend(model.args, cfg.model.linear_attn_backend, device_type)
    kernel = "flash-linear-attention's chunked Triton kernels" if backend == "fla" else "the chunked PyTorch path"
    if wrapped and backend == "fla":
        kernel, why = "the chunked PyTorch path", "context parallelism hands each chunk its state"
    counts = [(name, sum(isinstance(m, kind) and id(m) not in wrapped for m in cores)) for name, kind in kinds.items()]
    what = " and ".join(f"{name} in {n} of {layers} layers" for name, n in counts if n)
    return f"  linear attention: {what}, by {kernel}" + (f" ({why})" if why else "")


def describe_experts(cfg: JobConfig, model: nn.Module, device: torch.device, dtype: torch.dtype) -> str | None:
    """How a mixture of experts' routed experts compute (moe.experts_kernel "auto" and what the device and
    dtype allow); None for a dense model."""
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    if not experts:
        return None
    what = f"  experts: {len(experts)} blocks of {experts[0].w1.shape[0]} experts, "
    hidden, dim = experts[0].w1.shape[1], experts[0].w1.shape[2]
    why = {
        None: "",
        LOOP_CHOSEN: "moe.experts_kernel loop",
        LOOP_COMPILED: f"torch.compile's grouped_mm takes bfloat16, not {dtype}",
        LOOP_UNALIGNED: f"widths {dim} and {hidden} are not 16-byte aligned for grouped_mm",
        LOOP_UNSUPPORTED: f"torch._grouped_mm does not run for {dtype} on {device.type}",
    }[experts[0].loop_reason(device, dtype, compiling=cfg.compile.enable)]
    what += experts_over_tp(cfg.parallelism)
    if not why:
        return what + "torch._grouped_mm (one kernel for every expert of a block)"
    return what + f"a loop over the experts ({why})"


def experts_over_tp(p) -> str:
    """Under tensor parallelism, whether each expert is split over the TP ranks or whole on each of them."""
    if p.tensor_parallel_degree == 1:
        return ""
    if p.expert_tensor_parallel_degree > 1:
        return f"each split over the {p.tensor_parallel_degree} tensor-parallel ranks, "
    return (
        f"whole on each of the {p.tensor_parallel_degree} tensor-parallel ranks "
        f"(parallelism.expert_tensor_parallel_degree = {p.tensor_parallel_degree} splits them), "
    )


def describe_active(model, n_params: int) -> str:
    """For a mixture of experts, the parameters one token uses (and that MFU and TFLOP/s count); "" if dense."""
    active = active_parameters(model)
    if active == n_params:
        return ""
    return f"{active:,} active per token ({active / 1e6:.1f} M; MFU and TFLOP/s count these), "


def describe_attention(cfg: JobConfig, cp: int, model: nn.Module, device_type: str) -> str:
    """The attention mask, the kernel each layer's attention runs (and its windows, softcap and sinks), and how
    context parallelism splits each sequence."""
    mask = "block-causal (a token sees earlier tokens of its own document only)"
    line = "  attention: " + (mask if cfg.model.attn_mask_type == "block_causal" else "causal")
    plain = cfg.model.attn_mask_type == "causal" and cp == 1
    line += "; " + attention_kernels(model, plain, device_type, cfg.training.seq_len)
    if cp > 1:
        chunk = cfg.training.seq_len // (2 * cp)
        line += (
            f"; context parallel {cp}: each rank holds 2 chunks of {chunk} tokens of every "
            f"{cfg.training.seq_len}-token sequence (balanced), keys and values gathered over the cp group"
        )
    return line
