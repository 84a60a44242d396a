"""A run's plan: every check that can be made from a config and a world size before any process group
exists (`titanlite check` runs them before torchrun starts a worker; each worker runs them again)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from titanlite.base.devices import device_type
from titanlite.base.errors import ConfigError
from titanlite.components.checkpoint import initial_weights_path
from titanlite.components.hf_weights import check_hf_folders
from titanlite.components.loss import chunk_tokens, schedule_of
from titanlite.components.muon import check_muon_params
from titanlite.components.profiling import check_profiling
from titanlite.components.wandb_run import check_wandb
from titanlite.config import JobConfig, grad_accum_steps
from titanlite.data.tokenizer import Tokenizer, build_tokenizer
from titanlite.models.build import configured_args, linear_backend, model_from_args
from titanlite.parallel.context_parallel import check_cp_degree
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.expert_parallel import check_ep_degree
from titanlite.parallel.expert_tensor_parallel import check_etp_degree
from titanlite.parallel.float8 import check_float8, check_float8_filter
from titanlite.parallel.parallelize import loss_parallel_enabled
from titanlite.parallel.pipeline import (
    V_SHAPED,
    PipelinePlan,
    check_pipeline_data_parallel,
    check_pp_degree,
    plan_pipeline,
)
from titanlite.parallel.tensor_parallel import check_tp_degree


@dataclass(frozen=True)
class ModelPlan:
    """The run's tokenizer and model arguments, derived from the config once per process and handed to whatever
    builds, measures or records the model, so that no two of them can derive different ones."""

    tokenizer: Tokenizer
    args: Any  # the family's arguments for this vocabulary and training.seq_len, with the [moe] settings applied
    family: str  # the family's name, as the checks' messages give it

    @classmethod
    def of(cls, cfg: JobConfig, tokenizer: Tokenizer) -> ModelPlan:
        """The model arguments for a tokenizer that the caller has built already (`titanlite generate`)."""
        args = configured_args(cfg.model, tokenizer.vocab_size, cfg.training.seq_len, cfg.moe, cfg.training)
        return cls(tokenizer, args, getattr(args, "family", cfg.model.name))


def plan_model(cfg: JobConfig) -> ModelPlan:
    """The [model] section's tokenizer and model arguments (commands that build a model without a run's plan
    start here; plan_run does too)."""
    return ModelPlan.of(cfg, build_tokenizer(cfg.model.tokenizer, cfg.model.hf_assets_path))


@dataclass(frozen=True)
class LossMode:
    """How the loss runs on this layout, decided once: loss parallelism (TP's vocabulary-sharded logits) and the
    chunked loss's tokens per chunk (training.loss_chunk_tokens resolved; 0: the whole logits)."""

    parallel: bool
    chunk_tokens: int


def plan_loss(cfg: JobConfig, dims: ParallelDims) -> LossMode:
    parallel = loss_parallel_enabled(dims, cfg.parallelism)
    return LossMode(parallel, chunk_tokens(cfg.training, cfg.compile, parallel, schedule_of(cfg.parallelism)))


@dataclass(frozen=True)
class Plan:
    """What validation resolves from a config and a world size, before any process group exists: made once per
    process (plan_run) and handed to every builder."""

    dims: ParallelDims
    grad_accum_steps: int
    global_batch_size: int
    pipeline: PipelinePlan | None
    model: ModelPlan
    loss: LossMode


def plan_run(cfg: JobConfig, world_size: int, evaluation: bool = False) -> Plan:
    """Every check that can be made without a process group; raises ConfigError naming the knob. `evaluation`:
    the plan of `titanlite eval`, whose [validation] keys are checked whether validation.enable is on or not,
    and which reads checkpoints without training (checkpoint.load_step needs no checkpoint.enable)."""
    check_run_folder(cfg)
    if not evaluation:
        check_resume_keys(cfg.checkpoint)
        check_wandb(cfg.metrics)
    dims = ParallelDims.from_config(cfg.parallelism, world_size, cpu_offload=cfg.training.enable_cpu_offload)
    accum = grad_accum_steps(cfg.training, dims.dp)
    model = plan_model(cfg)
    args = model.args
    check_tp_degree(dims.tp, args, cfg.training.seq_len)
    check_pp_degree(dims.pp, args)
    check_ep_degree(dims.ep, args, model.family)
    check_etp_degree(dims.etp, args, model.family)
    check_layout_features(cfg, dims, getattr(args, "conv_size", 1))
    muon_names = cfg.optimizer.name == "Muon" and bool(cfg.optimizer.muon_params) and not evaluation
    float8_names = cfg.float8.enable and bool(cfg.float8.filter_fqns) and not evaluation
    if muon_names or float8_names:
        with torch.device("meta"):  # the parameters' and layers' names and shapes, no memory
            named = model_from_args(args)
        if muon_names:
            check_muon_params(named, cfg.optimizer.muon_params)
    check_compile_mode(cfg, dims, accum)
    check_float8(cfg.float8)
    if float8_names:
        check_float8_filter(named, cfg.float8.filter_fqns, model.family)
    # "fla" where it cannot import: refused before launch (its smoke check runs in the workers, on their devices)
    linear_backend(args, cfg.model.linear_attn_backend, device_type(), smoke=False)
    check_profiling(cfg.profiling)
    check_async_mode(cfg.checkpoint)
    if cfg.parallelism.enable_async_tensor_parallel:
        raise ConfigError(
            "parallelism.enable_async_tensor_parallel needs CUDA and torch.compile (NCCL symmetric memory), and "
            "titanlite has not run it on a GPU yet; set it to false"
        )
    if cfg.checkpoint.initial_load_path and not Path(cfg.checkpoint.initial_load_path).is_dir():
        raise ConfigError(
            f"checkpoint.initial_load_path='{cfg.checkpoint.initial_load_path}' is not a folder; name a "
            "DCP checkpoint folder (step-N) or a Hugging Face model folder"
        )
    check_hf_folders(cfg.model, initial_weights_path(cfg), args, training=not evaluation)
    pipeline = plan_pipeline(cfg.parallelism, args.n_layers, cfg.training.local_batch_size * accum)
    if cfg.downstream.tasks:
        check_downstream(cfg, pipeline, evaluation)
    if cfg.validation.enable or evaluation or cfg.downstream.tasks:
        check_validation(cfg, pipeline, args.max_seq_len)
    batch = cfg.training.local_batch_size * dims.dp * accum
    return Plan(dims, accum, batch, pipeline, model, plan_loss(cfg, dims))


def check_run_folder(cfg: JobConfig) -> None:
    """The run folder {job.dump_folder}/{job.name} can be a folder: nothing on its path is a file."""
    run_dir = Path(cfg.job.dump_folder) / cfg.job.name
    for path in (*reversed(run_dir.parents), run_dir):
        if path.exists() and not path.is_dir():
            key = "job.name" if path == run_dir else "job.dump_folder"
            raise ConfigError(f"{path} is a file, so the run folder {run_dir} cannot be made; set {key} to a folder")


def check_resume_keys(checkpoint) -> None:
    """Checkpoint keys that a training run would otherwise ignore."""
    if checkpoint.load_step != -1 and not checkpoint.enable:
        raise ConfigError(
            f"checkpoint.load_step={checkpoint.load_step} resumes from a checkpoint, but checkpoint.enable is false "
            "(nothing would be loaded and the run would start over); set checkpoint.enable = true"
        )
    if checkpoint.start_from_scratch and checkpoint.load_step != -1:
        raise ConfigError(
            f"checkpoint.start_from_scratch loads no checkpoint, but checkpoint.load_step={checkpoint.load_step} "
            "names one; keep one of the two"
        )


def check_compile_mode(cfg: JobConfig, dims: ParallelDims, accum: int) -> None:
    """compile.mode 'reduce-overhead' (CUDA graphs per block) only where it was measured to work: one forward
    and backward per step. With gradient accumulation on an H100 (torch 2.11) a block's saved output was
    overwritten by the next replay before backward read it; pipeline schedules run several micro-batches per
    step in the same way."""
    if not (cfg.compile.enable and cfg.compile.mode == "reduce-overhead"):
        return
    if accum > 1:
        raise ConfigError(
            f"compile.mode='reduce-overhead' with {accum} gradient accumulation steps fails (a CUDA graph overwrites "
            "outputs that backward still needs); set training.global_batch_size = local_batch_size x data-parallel "
            "degree, or compile.mode = 'default'"
        )
    if dims.pp_enabled:
        raise ConfigError(
            "compile.mode='reduce-overhead' under pipeline parallelism replays CUDA graphs over several micro-batches "
            "per step, which overwrites outputs that backward still needs; set compile.mode = 'default'"
        )


def check_layout_features(cfg: JobConfig, dims: ParallelDims, conv_size: int = 1) -> None:
    """Features that this layout, this device or this torch cannot combine. `conv_size`: the width of the model's
    linear-attention convolutions (1: none), whose reach each context-parallel chunk must cover."""
    compiles_blocks = cfg.compile.enable and "model" in cfg.compile.components
    if dims.tp_enabled and compiles_blocks and cfg.activation_checkpoint.mode != "none":
        raise ConfigError(
            "activation_checkpoint.mode with compile.enable under tensor parallelism fails inside torch 2.13 "
            "(a DeviceMesh among the tensors saved for backward); set activation_checkpoint.mode = 'none' or "
            "compile.enable = false"
        )
    if cfg.training.enable_cpu_offload and device_type() != "cuda":
        raise ConfigError(
            "training.enable_cpu_offload moves FSDP shards between CUDA and host memory; there is no CUDA device "
            "here, set it to false"
        )
    if cfg.training.enable_cpu_offload and not dims.fsdp_enabled:
        raise ConfigError(
            "training.enable_cpu_offload offloads FSDP shards, but this layout has no FSDP "
            f"(dp_shard = {dims.dp_shard}); use parallelism.data_parallel_shard_degree > 1 (or one GPU) or set it to "
            "false"
        )
    check_pipeline_data_parallel(dims)
    check_cp_degree(dims.cp, cfg.training.seq_len, conv_size=conv_size)
    if dims.cp_enabled and cfg.validation.enable:
        check_cp_degree(dims.cp, cfg.validation.seq_len or cfg.training.seq_len, "validation.seq_len", conv_size)
    if cfg.training.skips_steps() and cfg.optimizer.implementation not in ("auto", "fused"):
        knob = "training.skip_nonfinite_steps" if cfg.training.skip_nonfinite_steps else "training.spike_factor"
        raise ConfigError(
            f"{knob} skips a bad step's update on the device, which only the fused AdamW "
            f"can do; set optimizer.implementation = 'fused' (or 'auto'), not '{cfg.optimizer.implementation}'"
        )


def check_async_mode(checkpoint) -> None:
    """async_with_pinned_mem needs DCP's stager (torch.distributed.checkpoint.staging), refused up front
    where this torch lacks it rather than failing at the first save."""
    if checkpoint.enable and checkpoint.async_mode == "async_with_pinned_mem":
        try:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: F401 (a probe)
        except ImportError:
            raise ConfigError(
                f"checkpoint.async_mode='async_with_pinned_mem' needs DCP's DefaultStager, which torch "
                f"{torch.__version__} lacks; use checkpoint.async_mode = 'async'"
            ) from None


def validation_batch_size(cfg: JobConfig) -> int:
    return cfg.validation.local_batch_size or cfg.training.local_batch_size


def check_validation(cfg: JobConfig, pipeline: PipelinePlan | None, max_seq_len: int) -> None:
    if pipeline and pipeline.schedule in V_SHAPED:
        raise ConfigError(
            f"validation under pipeline_parallel_schedule={pipeline.schedule} fails inside torch's forward-only "
            "path (schedule.eval steals backward inputs); use Interleaved1F1B or InterleavedZeroBubble, or set "
            "validation.enable = false (`titanlite eval` can evaluate its checkpoints on another schedule)"
        )
    if pipeline and validation_batch_size(cfg) % pipeline.n_microbatches:
        raise ConfigError(
            f"validation batches of {validation_batch_size(cfg)} windows per rank cannot be cut into the pipeline's "
            f"{pipeline.n_microbatches} micro-batches; set validation.local_batch_size to a multiple of "
            f"{pipeline.n_microbatches}"
        )
    seq_len = cfg.validation.seq_len or cfg.training.seq_len
    if seq_len > max_seq_len:
        raise ConfigError(
            f"validation.seq_len={seq_len} is longer than the model's {max_seq_len} positions; "
            f"use validation.seq_len <= {max_seq_len}"
        )


def check_downstream(cfg: JobConfig, pipeline: PipelinePlan | None, evaluation: bool) -> None:
    """What [downstream] asks that the run cannot do: an interval past the last step, or under pipeline parallelism a
    schedule without a forward-only path or a batch other than the validation batch (the stages keep one shape)."""
    d = cfg.downstream
    if not evaluation and d.interval > cfg.training.steps:
        raise ConfigError(
            f"downstream.interval={d.interval} is past the run's last step (training.steps={cfg.training.steps}); set "
            f"downstream.interval to at most {cfg.training.steps} (the last step is always scored)"
        )
    if pipeline and pipeline.schedule in V_SHAPED:
        raise ConfigError(
            f"downstream tasks under pipeline_parallel_schedule={pipeline.schedule} would fail inside torch's "
            "forward-only path (schedule.eval steals backward inputs); use Interleaved1F1B or InterleavedZeroBubble, "
            "or score the run's checkpoints with `titanlite eval --tasks` on another schedule"
        )
    if pipeline and d.batch_size not in (0, validation_batch_size(cfg)):
        raise ConfigError(
            f"downstream.batch_size={d.batch_size} under pipeline parallelism: the stages score in the validation "
            f"batch's shape ({validation_batch_size(cfg)} rows per rank, validation.local_batch_size or "
            "training.local_batch_size); set downstream.batch_size = 0, or change validation.local_batch_size"
        )
