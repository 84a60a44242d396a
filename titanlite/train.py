"""Entry point of a training worker (`torchrun -m titanlite.train`): build each piece, hand them to the Trainer.

`titanlite check` runs the same validation in one process before torchrun starts any worker.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from titanlite.config import JobConfig, grad_accum_steps, help_text, parse_config, to_toml
from titanlite.errors import ConfigError
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.pipeline import PipelinePlan, plan_pipeline


@dataclass
class Plan:
    """What validation resolves from a config and a world size, before any process group exists."""

    dims: ParallelDims
    grad_accum_steps: int
    global_batch_size: int
    pipeline: PipelinePlan | None


def plan_run(cfg: JobConfig, world_size: int, validation: bool = False) -> Plan:
    """Every check that can be made without a process group; raises ConfigError naming the knob
    (those of the [validation] section too when it is enabled or `validation` asks for them)."""
    from titanlite.data.tokenizer import build_tokenizer
    from titanlite.models.registry import configured_args
    from titanlite.parallel.float8 import check_float8
    from titanlite.profiling import check_profiling
    from titanlite.parallel.tensor_parallel import check_tp_degree

    from titanlite.devices import device_type

    dims = ParallelDims.from_config(cfg.parallelism, world_size, cpu_offload=cfg.training.enable_cpu_offload)
    accum = grad_accum_steps(cfg.training, dims.dp)
    m = cfg.model
    vocab_size = build_tokenizer(m.tokenizer, m.hf_assets_path).vocab_size
    args = configured_args(m, vocab_size, cfg.training.seq_len)
    check_tp_degree(dims.tp, args, cfg.training.seq_len)
    compiles_blocks = cfg.compile.enable and "model" in cfg.compile.components
    if dims.tp_enabled and compiles_blocks and cfg.activation_checkpoint.mode != "none":
        raise ConfigError(
            "activation_checkpoint.mode with compile.enable under tensor parallelism fails inside torch 2.13 "
            "(a DeviceMesh among the tensors saved for backward); set activation_checkpoint.mode = 'none' or "
            "compile.enable = false"
        )
    if cfg.training.enable_cpu_offload and device_type() != "cuda":
        raise ConfigError("training.enable_cpu_offload moves FSDP shards between CUDA and host memory; there is no CUDA device here, set it to false")
    if cfg.training.enable_cpu_offload and not dims.fsdp_enabled:
        raise ConfigError(
            "training.enable_cpu_offload offloads FSDP shards, but this layout has no FSDP "
            f"(dp_shard = {dims.dp_shard}); use parallelism.data_parallel_shard_degree > 1 (or one GPU) or set it to false"
        )
    if cfg.training.skip_nonfinite_steps and cfg.optimizer.implementation not in ("auto", "fused"):
        raise ConfigError(
            "training.skip_nonfinite_steps skips a bad step's update on the device, which only the fused AdamW "
            f"can do; set optimizer.implementation = 'fused' (or 'auto'), not '{cfg.optimizer.implementation}'"
        )
    check_float8(cfg.float8)
    check_profiling(cfg.profiling)
    check_async_mode(cfg.checkpoint)
    if cfg.parallelism.enable_async_tensor_parallel:
        raise ConfigError(
            "parallelism.enable_async_tensor_parallel needs CUDA and torch.compile, which titanlite does not "
            "offer yet; set it to false"
        )
    if cfg.training.dataset == "local" and cfg.training.dataset_path and not Path(cfg.training.dataset_path).exists():
        raise ConfigError(f"training.dataset_path='{cfg.training.dataset_path}' does not exist")
    pipeline = plan_pipeline(cfg.parallelism, args.n_layers, cfg.training.local_batch_size * accum)
    if cfg.validation.enable or validation:
        check_validation(cfg, pipeline, args.max_seq_len)
    return Plan(dims, accum, cfg.training.local_batch_size * dims.dp * accum, pipeline)


def check_async_mode(checkpoint) -> None:
    """async_with_pinned_mem needs DCP's stager (torch.distributed.checkpoint.staging), refused up front
    where this torch lacks it rather than failing at the first save."""
    if checkpoint.enable and checkpoint.async_mode == "async_with_pinned_mem":
        try:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: F401
        except ImportError:
            raise ConfigError(f"checkpoint.async_mode='async_with_pinned_mem' needs DCP's DefaultStager, which torch "
                              f"{torch.__version__} lacks; use checkpoint.async_mode = 'async'") from None


def describe_model(cfg: JobConfig) -> str:
    m = cfg.model
    return f"{m.name} {m.flavor}" + (f" (from {m.hf_assets_path})" if m.flavor == "hf" else "")


def validation_batch_size(cfg: JobConfig) -> int:
    return cfg.validation.local_batch_size or cfg.training.local_batch_size


def check_validation(cfg: JobConfig, pipeline: PipelinePlan | None, max_seq_len: int) -> None:
    from titanlite.parallel.pipeline import V_SHAPED

    if pipeline and pipeline.schedule in V_SHAPED:
        raise ConfigError(
            f"validation under pipeline_parallel_schedule={pipeline.schedule} fails inside torch's forward-only "
            "path (schedule.eval steals backward inputs); use Interleaved1F1B or InterleavedZeroBubble, or set "
            "validation.enable = false (`titanlite eval` can evaluate its checkpoints on another schedule)"
        )
    if pipeline and validation_batch_size(cfg) % pipeline.n_microbatches:
        raise ConfigError(
            f"validation batches of {validation_batch_size(cfg)} windows per rank cannot be cut into the pipeline's "
            f"{pipeline.n_microbatches} micro-batches; set validation.local_batch_size to a multiple of {pipeline.n_microbatches}"
        )
    seq_len = cfg.validation.seq_len or cfg.training.seq_len
    if seq_len > max_seq_len:
        raise ConfigError(f"validation.seq_len={seq_len} is longer than the model's {max_seq_len} positions; "
                          f"use validation.seq_len <= {max_seq_len}")


def cache_dir(cfg: JobConfig) -> Path:
    return Path(cfg.data.cache_dir or os.environ.get("TITANLITE_CACHE_DIR") or Path.home() / ".cache" / "titanlite")


def build_data(cfg: JobConfig, verify: str = "stat", say=None):
    """Tokenizer and corpus (windows and sample order) of the configured data, from prepared token stores.

    Training ranks check a store's sources by size and mtime only (verify='stat': no source is read);
    `titanlite check` and `prepare` also compare sampled fingerprints, or every byte with
    data.verify_sources. A missing or outdated store is built first, by one process at a time. Each
    source's last validation.split_fraction is held out of training unless validation names its own corpus."""
    from titanlite.data.datasets import build_corpus, configured_sources
    from titanlite.data.tokenizer import build_tokenizer

    t = cfg.training
    tokenizer = build_tokenizer(cfg.model.tokenizer, cfg.model.hf_assets_path)
    sources = configured_sources(t.dataset, t.dataset_path, t.dataset_mixture)
    holdout = 0.0 if separate_validation(cfg) else cfg.validation.split_fraction
    corpus = build_corpus(sources, tokenizer, cache_dir(cfg), t.seq_len, t.seed, cfg.data.shuffle, holdout=holdout,
                          **store_options(cfg, verify), say=say)
    return tokenizer, corpus


def separate_validation(cfg: JobConfig) -> bool:
    return bool(cfg.validation.dataset or cfg.validation.dataset_path)


def build_validation_data(cfg: JobConfig, tokenizer, corpus, verify: str = "stat", say=None):
    """The validation windows: the training corpus's held-out tails, or validation.dataset(_path) whole."""
    from titanlite.data.datasets import configured_sources, validation_windows
    from titanlite.data.store import open_store

    v = cfg.validation
    seq_len = v.seq_len or cfg.training.seq_len
    if not separate_validation(cfg):
        return validation_windows(corpus.stores, corpus.split, seq_len)
    sources = configured_sources(v.dataset or "local", v.dataset_path, [], section="validation")
    stores = [open_store(source, tokenizer, cache_dir(cfg), **store_options(cfg, verify), say=say) for source, _ in sources]
    return validation_windows(stores, [0] * len(stores), seq_len)


def store_options(cfg: JobConfig, verify: str) -> dict:
    """How open_store checks and builds stores under this config: data.verify_sources turns a fingerprint
    check into a full one (ranks keep their stat check), plus the prepare workers and shard size."""
    d = cfg.data
    return {"verify": "full" if d.verify_sources and verify != "stat" else verify,
            "workers": d.prepare_workers, "shard_bytes": int(d.shard_size_mb * 2**20)}


def build_loader(cfg: JobConfig, corpus, mesh, plan: Plan, device: torch.device):
    from titanlite.data.loader import TokenLoader

    dp_rank = mesh["dp"].get_local_rank() if mesh is not None and "dp" in mesh else 0
    return TokenLoader(
        corpus.windows,
        corpus.order,
        local_batch_size=cfg.training.local_batch_size,
        grad_accum_steps=plan.grad_accum_steps,
        dp_rank=dp_rank,
        dp_degree=plan.dims.dp,
        num_workers=cfg.data.num_workers,
        prefetch=cfg.data.prefetch,
        pin_device=device if cfg.data.pin_memory else None,
    )


def build_model(cfg: JobConfig, vocab_size: int, plan: Plan, mesh, device: torch.device):
    """Build on the meta device, cut into pipeline stages if asked, apply the parallelisms to each part,
    then materialise and initialise the weights. Returns the whole meta model (for counting) and the parts."""
    from titanlite.models.registry import configured_model
    from titanlite.parallel.parallelize import materialize, parallelize, wrap_ddp
    from titanlite.parallel.pipeline import split_model

    with torch.device("meta"):
        model = configured_model(cfg.model, vocab_size, cfg.training.seq_len)
    parts = split_model(model, plan.pipeline, mesh["pp"].get_local_rank()) if plan.pipeline else [model]
    parts = [
        parallelize(part, plan.dims, mesh, cfg.parallelism, cfg.training, device, cfg.activation_checkpoint, cfg.compile, cfg.float8)
        for part in parts
    ]
    for part in parts:
        materialize(part, device, cfg.training.seed, cpu_offload=cfg.training.enable_cpu_offload)
    return model, [wrap_ddp(part, plan.dims, mesh) for part in parts]


def build_pipeline(cfg: JobConfig, plan: Plan, model, parts, mesh, device: torch.device, loss_fn):
    """The schedule over this rank's stages, with the tied-embedding sync and the stage timer."""
    from titanlite.parallel.pipeline import StageTimer, TiedEmbeddingSync, build_schedule
    from titanlite.trainer import Pipeline

    pp_rank, group = mesh["pp"].get_local_rank(), mesh["pp"].get_group()
    schedule, stages = build_schedule(
        parts, plan.pipeline, group, pp_rank, device, loss_fn, cfg.parallelism.pipeline_parallel_schedule_csv
    )
    stage_ids = plan.pipeline.stage_ids(pp_rank)
    tied = model.args.tie_embeddings
    return Pipeline(
        schedule=schedule,
        has_first=0 in stage_ids,
        has_last=plan.pipeline.num_stages - 1 in stage_ids,
        group=group,
        timer=StageTimer(stages, device),
        tied_sync=TiedEmbeddingSync(parts, plan.pipeline, mesh.root, pp_rank) if tied else None,
        analytic_bubble=plan.pipeline.analytic_bubble(),
    )


def build_checkpointer(cfg: JobConfig, run_dir: Path, model, parts, plan: Plan, optimizer, lr_scheduler, loader, mesh, say):
    from titanlite.checkpoint import Checkpointer, initial_weights_path

    # Under PP a tied embedding's copy lives in the last stage's part as output.weight.
    tied_copy_parts = set()
    if plan.pipeline and model.args.tie_embeddings:
        tied_copy_parts = {i for i, part in enumerate(parts) if part.output is not None and part.tok_embeddings is None}
    return Checkpointer(
        cfg.checkpoint, run_dir, parts, optimizer, lr_scheduler, loader,
        tied_copy_parts=tied_copy_parts,
        final_step=cfg.training.stop_after_step or cfg.training.steps,
        initial_load_path=initial_weights_path(cfg),
        say=say,
    )


def keep_metrics_up_to(path: Path, step: int) -> None:
    """A fresh run starts a fresh record; a resumed one keeps the records up to the step it resumed from
    (later ones belong to the interrupted attempt and will be written again)."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if step and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in kept))


def init_distributed(world_size: int, init_timeout_seconds: float, one_rank_mesh: bool = False) -> torch.device:
    """This rank's device (titanlite.devices) and, for several ranks, the process group: NCCL on CUDA,
    gloo on the CPU. One rank gets an in-memory group too when its mesh has a one-rank dimension
    (FSDP on a single device) or DCP's process-based saver needs one (async_with_pinned_mem)."""
    from titanlite.devices import local_device

    device = local_device(int(os.environ.get("LOCAL_RANK", 0)))
    backend = "nccl" if device.type == "cuda" else "gloo"
    device_id = device if device.type == "cuda" else None
    timeout = timedelta(seconds=init_timeout_seconds)
    if world_size > 1:
        dist.init_process_group(backend, timeout=timeout, device_id=device_id)
    elif one_rank_mesh and not dist.is_initialized():
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, device_id=device_id)
    return device


def set_determinism(cfg: JobConfig) -> None:
    torch.manual_seed(cfg.training.seed)
    deterministic = cfg.training.deterministic
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    # TF32 for float32 matmuls is free speed on Ampere and later, but changes results: off when deterministic.
    torch.backends.cuda.matmul.allow_tf32 = not deterministic
    torch.backends.cudnn.allow_tf32 = not deterministic


def keep_freed_memory_on_cpu() -> bool:
    """On the CPU, tell glibc's malloc to keep freed memory for reuse instead of returning it to the OS.

    By default every allocation above 32 MiB (the logits, the vocabulary-sized gradients) is a fresh
    mmap that the kernel must fault in and zero page by page, on every step: on the debug model that was
    half of each step's wall time and most of its noise. Without mmap and trimming, freed blocks are
    reused: steps take about half the time (BENCHMARKS.md), at the cost of a resident size that stays at
    its peak. Set TITANLITE_CPU_MALLOC=default to keep glibc's behaviour. No-op off glibc."""
    if os.environ.get("TITANLITE_CPU_MALLOC", "") == "default" or not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_max = -1, -4
        return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))
    except (OSError, AttributeError):  # not glibc (e.g. musl)
        return False


def run(cfg: JobConfig) -> None:
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    plan = plan_run(cfg, world_size, validation=bool(os.environ.get("TITANLITE_EVAL")))
    set_determinism(cfg)
    from titanlite.checkpoint import needs_process_group

    one_rank_group = plan.dims.fsdp_single_rank or needs_process_group(cfg)
    device = init_distributed(world_size, cfg.comm.init_timeout_seconds, one_rank_mesh=one_rank_group)
    if device.type == "cpu":
        keep_freed_memory_on_cpu()
    if os.environ.get("TITANLITE_EVAL"):  # titanlite eval
        run_eval(cfg, plan, device, rank)
        return
    trainer = build_trainer(cfg, plan, device, rank, world_size)
    measure_to = os.environ.get("TITANLITE_MEASURE_MEMORY", "")
    if measure_to:  # `titanlite plan --measure`: tensor-level peak memory of this rank, by category
        from titanlite.tools.plan import measure_peak

        measure_peak(trainer, plan.dims.fsdp_enabled, device, Path(measure_to) / f"rank{rank}.json", cfg.training.steps)
    else:
        trainer.train(cfg.training.steps, cfg.training.stop_after_step)
    trainer.checkpointer.close()
    trainer.logger.close()
    if rank == 0:
        print(f"  done: {cfg.training.steps} steps; metrics in {Path(cfg.job.dump_folder) / cfg.job.name / 'metrics.jsonl'}")


@dataclass
class Setup:
    """The model of a run on this rank, parallelised, with what a forward pass needs around it."""

    mesh: object
    device: torch.device
    plain_model: torch.nn.Module  # the whole model on the meta device (for counting)
    parts: list  # this rank's parallelised parts (one, or one per local pipeline stage)
    loss_parallel: bool
    loss_fn: object
    pipeline: object  # trainer.Pipeline or None
    param_dtype: torch.dtype
    autocast: object
    loss_line: str  # which loss runs, for the log


def build_setup(cfg: JobConfig, plan: Plan, mesh, device: torch.device, vocab_size: int, say) -> Setup:
    from titanlite.loss import build_loss, chunk_tokens, cross_entropy
    from titanlite.parallel.compile import compiled_loss
    from titanlite.parallel.parallelize import DTYPES, loss_parallel_enabled
    from titanlite.trainer import autocast_for

    plain_model, parts = build_model(cfg, vocab_size, plan, mesh, device)
    loss_parallel = loss_parallel_enabled(plan.dims, cfg.parallelism)
    compile_loss = cfg.compile.enable and "loss" in cfg.compile.components
    chunks = chunk_tokens(cfg.training, cfg.compile, loss_parallel)
    loss_fn = compiled_loss(build_loss(parts, chunks, compile_loss, cfg.compile.backend), cfg.compile, loss_parallel)
    if chunks:
        loss_line = f"  loss: cross-entropy in chunks of {chunks} tokens, no full logits (training.loss_chunk_tokens)"
    elif loss_fn is cross_entropy and compile_loss:
        loss_line = "  compile: the loss stays eager under loss parallelism (torch 2.13 computes it wrongly when compiled)"
    else:
        loss_line = "  loss: cross-entropy on the whole logits" + (" (compiled)" if compile_loss else "")
    pipeline = build_pipeline(cfg, plan, plain_model, parts, mesh, device, loss_fn) if plan.pipeline else None
    param_dtype = DTYPES[cfg.training.mixed_precision_param] if device.type == "cuda" else torch.float32
    return Setup(mesh, device, plain_model, parts, loss_parallel, loss_fn, pipeline, param_dtype,
                 autocast_for(device, parts[0], param_dtype), loss_line)


def build_validator(cfg: JobConfig, plan: Plan, setup: Setup, windows):
    from titanlite.validate import Validator

    mesh = setup.mesh
    return Validator(
        windows,
        local_batch_size=validation_batch_size(cfg),
        steps=cfg.validation.steps,
        dp_rank=mesh["dp"].get_local_rank() if mesh is not None and "dp" in mesh else 0,
        dp_degree=plan.dims.dp,
        device=setup.device,
        model_parts=setup.parts,
        loss_group=mesh["dp_cp"].get_group() if plan.dims.dp > 1 else None,
        pipeline=setup.pipeline,
        loss_parallel=setup.loss_parallel,
        autocast=setup.autocast,
        loss_fn=setup.loss_fn,
    )


def describe_validation(cfg: JobConfig, windows: int, dp: int, schedule: bool = True) -> str:
    """One line: which windows each evaluation reads, from where, and (schedule) when it runs."""
    from titanlite.validate import num_windows

    v = cfg.validation
    if separate_validation(cfg):
        source = f"validation.dataset_path '{v.dataset_path}'" if v.dataset_path else f"validation.dataset '{v.dataset}'"
    else:
        source = f"the held-out last {v.split_fraction * 100:g}% of each training source"
    n = num_windows(windows, validation_batch_size(cfg), v.steps, dp)
    seq_len = v.seq_len or cfg.training.seq_len
    when = f", every {v.freq} steps and at the last" if schedule else ""
    return (f"validation: {n:,} windows of {seq_len} tokens ({n * seq_len:,} targets) from {source}{when}; "
            f"{validation_batch_size(cfg)} windows per rank per batch")


def run_eval(cfg: JobConfig, plan: Plan, device: torch.device, rank: int) -> dict:
    """`titanlite eval`'s worker: the configured layout's model with a checkpoint's weights, evaluated once."""
    from titanlite.checkpoint import checkpoint_to_load, load_weights
    from titanlite.validate import report

    say = print if rank == 0 else (lambda *a, **k: None)
    mesh = plan.dims.build_mesh(device.type)
    tokenizer, corpus = build_data(cfg, say=say)
    windows = build_validation_data(cfg, tokenizer, corpus, say=say)
    setup = build_setup(cfg, plan, mesh, device, tokenizer.vocab_size, say)
    validator = build_validator(cfg, plan, setup, windows)
    say(f"titanlite eval: {describe_model(cfg)} on {plan.dims.describe()}; "
        f"{describe_validation(cfg, len(windows), plan.dims.dp, schedule=False)}")
    path = checkpoint_to_load(cfg, "evaluate")
    load_weights(setup.parts, path)
    result = validator.run()
    report(result, path, say)
    return result


def build_trainer(cfg: JobConfig, plan: Plan, device: torch.device, rank: int, world_size: int):
    """Every piece of a run, resumed from its newest checkpoint if there is one, in a Trainer ready to
    train (also what `titanlite bench throughput` measures)."""
    from titanlite.metrics import MetricsLogger, count_params, device_peak_tflops, flops_per_token
    from titanlite.optim import LRSchedulers, Optimizers
    from titanlite.resilience import Faults, StopOnSignal
    from titanlite.parallel.float8 import Float8ScalePrecompute, describe_float8
    from titanlite.profiling import Profiler
    from titanlite.trainer import Resilience, StepFigures, Trainer

    say = print if rank == 0 else (lambda *a, **k: None)
    mesh = plan.dims.build_mesh(device.type)
    tokenizer, corpus = build_data(cfg, say=say)
    loader = build_loader(cfg, corpus, mesh, plan, device)
    setup = build_setup(cfg, plan, mesh, device, tokenizer.vocab_size, say)
    plain_model, parts, pipeline = setup.plain_model, setup.parts, setup.pipeline
    validator = build_validator(cfg, plan, setup, build_validation_data(cfg, tokenizer, corpus, say=say)) if cfg.validation.enable else None
    optimizer = Optimizers(parts, cfg.optimizer, device.type, skip_nonfinite=cfg.training.skip_nonfinite_steps)
    lr_scheduler = LRSchedulers(optimizer, cfg.lr_scheduler, cfg.training.steps)

    run_dir = Path(cfg.job.dump_folder) / cfg.job.name
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(to_toml(cfg))
    checkpointer = build_checkpointer(cfg, run_dir, plain_model, parts, plan, optimizer, lr_scheduler, loader, mesh, say)
    train_state = {"step": 0, "tokens_seen": 0}
    checkpointer.load(train_state)
    if rank == 0:
        keep_metrics_up_to(run_dir / "metrics.jsonl", train_state["step"])
    n_params = count_params(plain_model)
    say(f"titanlite: {cfg.job.name} {cfg.job.description}".rstrip())
    say(
        f"  model {describe_model(cfg)}: {n_params:,} parameters ({n_params / 1e6:.1f} M), "
        f"vocab {plain_model.args.vocab_size} (tokenizer {cfg.model.tokenizer}), seq_len {cfg.training.seq_len}, dtype {str(setup.param_dtype).removeprefix('torch.')}"
    )
    say(
        f"  layout: {plan.dims.describe()} on {world_size} {device.type} process(es); global batch "
        f"{plan.global_batch_size} = local {cfg.training.local_batch_size} x dp {plan.dims.dp} x accumulation "
        f"{plan.grad_accum_steps}; corpus {len(corpus.windows):,} windows of {cfg.training.seq_len + 1} tokens"
    )
    for line in corpus.describe(plan.global_batch_size * cfg.training.steps):
        say(f"  data: {line}")
    say(setup.loss_line)
    if validator is not None:
        say(f"  {describe_validation(cfg, len(validator.windows), plan.dims.dp)}")
    peak = device_peak_tflops(device, cfg.metrics.peak_tflops)
    if peak is None:
        say(f"  MFU: no known peak for this {device.type} device; set metrics.peak_tflops to report it")
    if cfg.float8.enable:
        say(describe_float8(cfg.float8, parts, device, plan.dims.fsdp_enabled))
    if plan.pipeline:
        pp = plan.pipeline
        say(
            f"  pipeline: {pp.schedule}, {pp.num_stages} stages ({pp.stages_per_rank} per rank), "
            f"{pp.n_microbatches} micro-batches of {cfg.parallelism.pipeline_parallel_microbatch_size}; {pp.describe()}"
        )
    trainer = Trainer(
        parts, optimizer, lr_scheduler, loader,
        grad_accum_steps=plan.grad_accum_steps,
        max_norm=cfg.training.max_norm,
        device=device,
        loss_group=mesh["dp_cp"].get_group() if plan.dims.dp > 1 else None,
        figures=StepFigures(
            tokens_per_step=plan.global_batch_size * cfg.training.seq_len,
            world_size=world_size,
            flops_per_token=flops_per_token(plain_model, cfg.training.seq_len),
            peak_tflops=peak,
        ),
        logger=MetricsLogger(run_dir, cfg.metrics.enable_tensorboard, active=rank == 0),
        log_freq=cfg.metrics.log_freq,
        throughput_warmup_steps=cfg.metrics.throughput_warmup_steps,
        autocast=setup.autocast,
        loss_parallel=setup.loss_parallel,
        pipeline=pipeline,
        checkpointer=checkpointer,
        loss_fn=setup.loss_fn,
        validator=validator,
        val_freq=cfg.validation.freq,
        after_optimizer_step=Float8ScalePrecompute(parts, cfg.float8, plan.dims.fsdp_enabled) or None,
        resilience=Resilience(
            stop=StopOnSignal(device),
            faults=Faults(os.environ.get("TITANLITE_FAULT", ""), rank),
            skip_nonfinite_steps=cfg.training.skip_nonfinite_steps,
            train_timeout_seconds=cfg.comm.train_timeout_seconds,
        ),
    )
    trainer.step, trainer.tokens_seen = train_state["step"], train_state["tokens_seen"]
    if cfg.profiling.enable_profiling:
        trainer.profiler = Profiler(cfg.profiling, run_dir, rank, device, lambda: trainer.step, say)
    return trainer


def main(argv: list[str] | None = None) -> int:
    """One worker's run; its exit status says how it ended (titanlite/failures.py), and a failure is
    one line on stderr with the traceback in the run folder."""
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    from titanlite.failures import record
    from titanlite.resilience import Preempted

    cfg = None
    try:
        cfg = parse_config(argv)
        run(cfg)
        return 0
    except Preempted as e:
        print(f"titanlite: {e}; run the same command to resume", flush=True)
        return 128 + e.signum
    except Exception as e:
        run_dir = Path(cfg.job.dump_folder) / cfg.job.name if cfg is not None else None
        return record(e, int(os.environ.get("RANK", 0)), run_dir)


def shutdown(code: int) -> None:
    """Leave without the abort-at-exit that DeviceMesh workers otherwise hit (CPU_DISTRIBUTED_NOTES.md)."""
    if dist.is_initialized():
        if code == 0:
            dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    try:
        exit_code = main()
    except BaseException:  # a training failure: show it, then leave through the same clean exit
        traceback.print_exc()
        exit_code = 1
    shutdown(exit_code)
