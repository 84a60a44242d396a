"""A run's model on this rank: built on the meta device, cut into pipeline stages, parallelised, materialised,
with the loss and the pipeline schedule around it (a RankModel, what the Trainer and Validator run)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from titanlite.base.devices import device_type
from titanlite.builder.plan import ModelPlan, Plan
from titanlite.components.expert_balance import ExpertBalance
from titanlite.components.loss import MultiTokenLoss, build_loss, cross_entropy, mtp_loss_names
from titanlite.config import JobConfig
from titanlite.engine.trainer import Pipeline, RankModel, StageLoss, autocast_for
from titanlite.models.build import linear_backend, model_from_args, with_kernels
from titanlite.models.common.interface import DecoderModule
from titanlite.models.common.latent.sparse import train_indexers_only
from titanlite.models.hf_config import mtp_note
from titanlite.models.registry import spec_of
from titanlite.parallel.compile import compiled_loss
from titanlite.parallel.context_parallel import SequenceSplit
from titanlite.parallel.float8 import Float8ScalePrecompute
from titanlite.parallel.parallelize import DTYPES, materialize, parallelize, wrap_ddp
from titanlite.parallel.pipeline import StageTimer, TiedEmbeddingSync, build_schedule, split_model


@dataclass
class ModelSetup:
    """The model of a run on this rank, with what the log says about it."""

    plain_model: DecoderModule  # the whole model on the meta device (for counting)
    rank: RankModel  # this rank's parallelised parts and how they run
    param_dtype: torch.dtype
    loss_line: str  # which loss runs, for the log


def plain_model(cfg: JobConfig, model: ModelPlan) -> DecoderModule:
    """The planned model, whole, on the current default device, parameters uninitialised: built from the plan's
    arguments (not from the config again), its attention cores of model.attn_backend's kind and its experts on
    moe.experts_kernel's path, its linear-attention layers on model.linear_attn_backend's, as configured_model
    (titanlite/models/build.py) makes them."""
    linear = linear_backend(model.args, cfg.model.linear_attn_backend, device_type())[0]
    return with_kernels(model_from_args(model.args), cfg.model.attn_backend, cfg.moe.experts_kernel, linear)


def build_model(cfg: JobConfig, plan: Plan, mesh, device: torch.device):
    """Build on the meta device, cut into pipeline stages if asked, apply the parallelisms to each part,
    then materialise and initialise the weights. Returns the whole meta model (for counting) and the parts."""
    with torch.device("meta"):
        model = plain_model(cfg, plan.model)
    parts = split_model(model, plan.pipeline, mesh["pp"].get_local_rank()) if plan.pipeline else [model]
    if indexer_warmup(model):
        for part in parts:  # before sharding, so every wrapper sees the weights it must not train
            train_indexers_only(part)
    parts = [parallelize_planned(part, cfg, plan, mesh, device, plan.loss.chunk_tokens > 0) for part in parts]
    for part in parts:
        materialize(part, device, cfg.training.seed, cpu_offload=cfg.training.enable_cpu_offload)
    return model, [wrap_ddp(part, plan.dims, mesh) for part in parts]


def indexer_warmup(model: DecoderModule) -> bool:
    """Whether the run is sparse attention's dense warm-up (training.indexer_dense_warmup): only the indexers train."""
    indexer = getattr(model.args, "indexer", None)
    return indexer is not None and indexer.dense_warmup


def parallelize_planned(
    part: DecoderModule, cfg: JobConfig, plan: Plan, mesh, device: torch.device, chunked_loss: bool
) -> DecoderModule:
    """`part` (on the meta device) with the configured parallelisms applied as `plan` lays them out
    (titanlite/parallel/parallelize.py); `chunked_loss`: the loss takes the hidden states and the head."""
    return parallelize(
        part,
        plan.dims,
        mesh,
        cfg.parallelism,
        cfg.training,
        device,
        cfg.activation_checkpoint,
        cfg.compile,
        cfg.float8,
        loss_parallel=plan.loss.parallel,
        chunked_loss=chunked_loss,
    )


def build_pipeline(
    cfg: JobConfig, plan: Plan, model, parts, mesh, device: torch.device, loss_fn, logits: bool
) -> Pipeline:
    """The schedule over this rank's stages, with the tied-embedding sync and the stage timer. `logits`: what
    the last stage returns for loss_fn (False: hidden states, for the chunked loss)."""
    assert plan.pipeline is not None  # built only under pipeline parallelism
    pp_rank, group = mesh["pp"].get_local_rank(), mesh["pp"].get_group()
    csv = cfg.parallelism.pipeline_parallel_schedule_csv
    loss = StageLoss(loss_fn)
    schedule, stages = build_schedule(parts, plan.pipeline, group, pp_rank, device, loss, csv, logits)
    stage_ids = plan.pipeline.stage_ids(pp_rank)
    # A tied head, or multi-token prediction's depths on the last stage, use a copy of the first stage's embedding.
    tied = model.args.tie_embeddings or getattr(model, "mtp", None) is not None
    return Pipeline(
        schedule=schedule,
        loss=loss,
        has_first=0 in stage_ids,
        has_last=plan.pipeline.num_stages - 1 in stage_ids,
        group=group,
        timer=StageTimer(stages, device),
        tied_sync=TiedEmbeddingSync(parts, plan.pipeline, mesh.root, pp_rank) if tied else None,
        analytic_bubble=plan.pipeline.analytic_bubble(),
        microbatches=plan.pipeline.n_microbatches,
    )


def sequence_split(cfg: JobConfig, plan: Plan, mesh) -> SequenceSplit:
    """How this rank cuts each batch's sequences (context parallelism) and finds its documents (block-causal)."""
    block_causal = cfg.model.attn_mask_type == "block_causal"
    eot = plan.model.tokenizer.eot_id if block_causal else None
    cp_rank = mesh["cp"].get_local_rank() if plan.dims.cp_enabled else 0
    return SequenceSplit(plan.dims.cp, cp_rank, eot)


def after_optimizer_step_hooks(cfg: JobConfig, plan: Plan, parts: list[nn.Module]) -> list[Callable[[int], None]]:
    """The hooks that run after each optimizer step, in order: float8's scales for FSDP's next all-gather."""
    float8_scales = Float8ScalePrecompute(parts, cfg.float8, plan.dims.fsdp_enabled)
    return [float8_scales] if float8_scales else []


def expert_balance(plan: Plan, mesh, parts: list[nn.Module], device: torch.device) -> ExpertBalance:
    """The MoE step hook: counts summed over the ranks that see other tokens (dp x cp, the loss's ranks), the
    worst block's load over the pipeline's stages."""
    group = mesh["dp_cp"].get_group() if plan.dims.dp * plan.dims.cp > 1 else None
    return ExpertBalance(parts, device, group, mesh["pp"].get_group() if plan.pipeline else None)


def indexer_line(model: DecoderModule, seq_len: int) -> str:
    """The start-up line of sparse attention (none without an indexer): how many keys a query reads, how the indexer
    trains, and where a sequence is too short for the selection to leave any key out."""
    indexer = getattr(model.args, "indexer", None)
    if indexer is None:
        return ""
    if indexer.dense_warmup:
        trained = sum(p.numel() for name, p in model.named_parameters() if ".indexer." in f".{name}")
        return (
            f"\n  sparse attention: dense warm-up (training.indexer_dense_warmup): the attention dense, the indexers "
            f"alone trained ({trained:,} weights, the rest frozen) on their loss x "
            f"{indexer.loss_coefficient:g} (training.indexer_loss_coefficient), logged as indexer_loss"
        )
    if indexer.topk >= seq_len:
        return (
            f"\n  sparse attention: index_topk={indexer.topk} covers training.seq_len={seq_len}, so every query reads "
            f"every key it sees: the attention runs dense, the indexer trained on its loss over every key x "
            f"{indexer.loss_coefficient:g} (training.indexer_loss_coefficient), logged as indexer_loss"
        )
    return (
        f"\n  sparse attention: each query reads the {indexer.topk} keys its layer's indexer selects (index_topk); "
        f"the indexer trained on its loss x {indexer.loss_coefficient:g} (training.indexer_loss_coefficient), "
        "logged as indexer_loss"
    )


def build_rank_model(cfg: JobConfig, plan: Plan, mesh, device: torch.device) -> ModelSetup:
    """This rank's parallelised model with its loss (chunked or plain, compiled or not) and pipeline."""
    plain, parts = build_model(cfg, plan, mesh, device)
    loss_parallel, chunks = plan.loss.parallel, plan.loss.chunk_tokens
    compile_loss = cfg.compile.enable and "loss" in cfg.compile.components
    loss_fn = compiled_loss(build_loss(parts, chunks, compile_loss, cfg.compile.backend), cfg.compile, loss_parallel)
    mtp = getattr(plain, "mtp_layers", 0)
    if mtp:
        loss_fn = MultiTokenLoss(loss_fn, mtp, cfg.training.mtp_loss_coefficient, cfg.training.seq_len)
    if chunks:
        loss_line = f"  loss: cross-entropy in chunks of {chunks} tokens, no full logits (training.loss_chunk_tokens)"
    elif loss_fn is cross_entropy and compile_loss:
        loss_line = (
            "  compile: the loss stays eager under loss parallelism (torch 2.13 computes it wrongly when compiled)"
        )
    else:
        loss_line = "  loss: cross-entropy on the whole logits" + (" (compiled)" if compile_loss else "")
    # A Hugging Face folder's multi-token prediction layers, said here, once: every process that reads the folder
    # (the launcher's check, each worker, convert) resolves them, and only this start-up line speaks for the run.
    folder_note = mtp_note(cfg.model.hf_assets_path, mtp) if cfg.model.flavor == "hf" else None
    if mtp:
        loss_line += (
            f"\n  multi-token prediction: {mtp} depth(s) after layer {plain.args.n_layers - 1}, loss = main + "
            f"{cfg.training.mtp_loss_coefficient:g} / {mtp} x their cross-entropies (training.mtp_loss_coefficient), "
            f"logged as {', '.join(mtp_loss_names(mtp))}" + (f"; {folder_note}" if folder_note else "")
        )
    elif folder_note:
        loss_line += f"\n  multi-token prediction: {folder_note}"
    loss_line += indexer_line(plain, cfg.training.seq_len)
    pipeline = build_pipeline(cfg, plan, plain, parts, mesh, device, loss_fn, not chunks) if plan.pipeline else None
    param_dtype = DTYPES[cfg.training.mixed_precision_param] if device.type == "cuda" else torch.float32
    hooks = after_optimizer_step_hooks(cfg, plan, parts)
    balance = expert_balance(plan, mesh, parts, device) if spec_of(plain.args).moe(plain.args) is not None else None
    if balance is not None:
        hooks.append(balance)
    rank = RankModel(
        parts=parts,
        device=device,
        loss_fn=loss_fn,
        logits=not chunks,
        loss_parallel=loss_parallel,
        autocast=autocast_for(device, parts[0], param_dtype),
        pipeline=pipeline,
        loss_group=mesh["dp_cp"].get_group() if plan.dims.dp * plan.dims.cp > 1 else None,
        split=sequence_split(cfg, plan, mesh),
        after_optimizer_step=hooks,
        expert_load=None if balance is None else lambda: balance.load,
        auxiliary_losses=spec_of(plain.args).auxiliary_losses(plain.args) + (mtp_loss_names(mtp) if mtp else ()),
        cuda_graphs=cfg.compile.enable and cfg.compile.mode == "reduce-overhead",
        mtp_layers=mtp,
        token_ids=getattr(plain, "reads_token_ids", False),
    )
    return ModelSetup(plain, rank, param_dtype, loss_line)
