"""The one place that turns a plain model into a parallel one, in a fixed order, then materialises it.

Order (docs/architecture.md): tensor parallel (with expert tensor parallelism, the experts split too) → expert
parallel → context parallel → float8 → activation checkpointing → compile → FSDP/HSDP (over data-parallel shards x
context-parallel ranks) or DDP. Beside them an MoE decoder's
load-balancing statistics are pooled over the ranks that share each micro-batch (pool_balance_over).
The float8 module swap itself runs first, because it replaces the linear modules that tensor parallelism
registers its hooks on; the tensor-parallel plan then shards the float8 layers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn as nn

from titanlite.config import ActivationCheckpoint, Compile, Float8, Parallelism, Training
from titanlite.models.common.decoder import Transformer
from titanlite.models.common.init import init_weights
from titanlite.models.common.interface import DecoderModule
from titanlite.models.common.moe.layer import MoE
from titanlite.models.registry import spec_of
from titanlite.parallel.activation_checkpoint import apply_ac
from titanlite.parallel.compile import apply_compile
from titanlite.parallel.context_parallel import apply_cp
from titanlite.parallel.data_parallel import ExpertSharding, apply_ddp, apply_fsdp
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.expert_parallel import apply_ep, expert_modules
from titanlite.parallel.float8 import apply_float8
from titanlite.parallel.tensor_parallel import apply_tp

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def reshard_after_forward(policy: str, pp_enabled: bool) -> bool:
    """'always' is ZeRO-3, 'never' is ZeRO-2; 'default' is ZeRO-3 except under pipeline parallelism,
    where each stage's parameters are reused by many micro-batches."""
    if policy == "default":
        return not pp_enabled
    return policy == "always"


def parallelize(
    model: DecoderModule,
    dims: ParallelDims,
    mesh,
    parallelism: Parallelism,
    training: Training,
    device: torch.device,
    ac: ActivationCheckpoint,
    compile_cfg: Compile,
    float8: Float8,
    *,
    loss_parallel: bool,
    chunked_loss: bool,
) -> DecoderModule:
    """Apply the parallelisms to a model still on the meta device; returns the (possibly wrapped) model. The loss's
    mode comes as the run planned it (titanlite/builder/plan.py LossMode): `loss_parallel`, TP's vocabulary-sharded
    logits; `chunked_loss`, the loss takes the hidden states and the head (titanlite/components/loss.py), so TP
    splits the head for it and FSDP keeps a tied head gathered until the loss has read it."""
    apply_float8(model, float8, fsdp=dims.fsdp_enabled, tp=dims.tp)
    if dims.tp_enabled:
        apply_tp(
            model,
            mesh["tp"],
            loss_parallel=loss_parallel,
            chunked_loss=chunked_loss,
            experts_split=dims.etp_enabled,
            ep=dims.ep_enabled,
        )
    if dims.ep_enabled:
        apply_ep(model, mesh["ep_tp"] if dims.etp_enabled else mesh["ep"])
    if dims.cp_enabled:
        apply_cp(model, mesh["cp"])
    if dims.dp * dims.cp > 1:
        pool_balance_over(model, mesh["dp_cp"].get_group())
    apply_ac(model, ac, compiled=compile_cfg.enable and "model" in compile_cfg.components)
    apply_compile(model, compile_cfg)
    if dims.fsdp_enabled:
        dp_mesh = mesh[("dp_replicate", "dp_shard_cp")] if dims.dp_replicate > 1 else mesh["dp_shard_cp"]
        experts = None
        if dims.ep_enabled:
            efsdp = mesh[("dp_replicate", "dp_shard_mod_ep")] if dims.dp_replicate > 1 else mesh["dp_shard_mod_ep"]
            divide = dims.dp_replicate * dims.view_degree("dp_shard_cp")
            n_experts = spec_of(model.args).moe(model.args).n_experts
            experts = ExpertSharding(expert_modules(model), efsdp, divide, n_experts // dims.ep)
        cuda = device.type == "cuda"
        apply_fsdp(
            model,
            dp_mesh,
            param_dtype=DTYPES[training.mixed_precision_param] if cuda else torch.float32,
            reduce_dtype=DTYPES[training.mixed_precision_reduce] if cuda else torch.float32,
            reshard_after_forward=reshard_after_forward(parallelism.fsdp_reshard_after_forward, dims.pp_enabled),
            cpu_offload=training.enable_cpu_offload,
            loss_reads_head=chunked_loss,
            experts=experts,
        )
    return model


def pool_balance_over(model: nn.Module, group: dist.ProcessGroup) -> None:
    """An MoE decoder's pooled load-balancing statistics summed over `group` (dp x cp: every rank that holds other
    tokens of the micro-batch, not the TP ranks, which hold the same ones) before the term is formed, as one process
    forms it over the whole micro-batch: the term is a product of means over all its tokens. Every rank then adds
    the same term, so the logged mean over dp x cp is one process's. The sum's backward sums the ranks' gradients,
    which the data-parallel gradient mean then divides by dp x cp. On a pipeline only the last stage sums (it forms
    the term from the totals the stages hand on), over the ranks of that stage. A family whose MoE blocks add their
    own (per-layer) term has each block sum its statistics alike (MoE.reduce)."""

    def reduce(totals: torch.Tensor) -> torch.Tensor:
        return dist_nn.all_reduce(totals, op=dist.ReduceOp.SUM, group=group)

    if isinstance(model, Transformer) and model.balance is not None:  # even a part with no MoE block forms the term
        model.balance.reduce = reduce
    for module in model.modules():
        if isinstance(module, MoE):
            module.reduce = reduce


def loss_parallel_enabled(dims: ParallelDims, parallelism: Parallelism) -> bool:
    return dims.tp_enabled and not parallelism.disable_loss_parallel


def wrap_ddp(model: nn.Module, dims: ParallelDims, mesh) -> nn.Module:
    """DDP wraps a materialised model (it broadcasts parameters at construction), so it comes after init."""
    return apply_ddp(model, mesh["dp_replicate"]) if dims.ddp_enabled else model


def materialize(model: DecoderModule, device: torch.device, seed: int, cpu_offload: bool = False) -> None:
    """Allocate the (sharded) parameters on `device` (in host memory under CPU offload, where FSDP keeps
    them), restore tied weights and buffers, and initialise."""
    model.to_empty(device="cpu" if cpu_offload else device)
    model.tie_weights()  # to_empty gives each module a new Parameter, which unties shared ones
    for module in model.modules():  # buffers (RoPE tables) are used where the compute runs
        # Setting a registered buffer's name replaces the tensor and keeps its registration (persistent or not).
        for key, buffer in list(module.named_buffers(recurse=False, remove_duplicate=False)):
            setattr(module, key, buffer.to(device))
    model.init_buffers()
    # Drawn on the compute device even when the shards live in host memory: a CPU generator draws other
    # numbers than a CUDA one from the same seed, and offload must start from the same weights.
    init_weights(model, seed, device)
