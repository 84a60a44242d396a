"""Optimizers (AdamW, or Muon beside AdamW), learning-rate schedule (warm-up then cosine/linear decay) and gradient
clipping.

Clipping works on plain and DTensor (sharded) gradients alike, on one mesh or on several (expert parameters
on their own mesh): the norm is taken over the full model. Partial gradients (a replicated weight used on
sharded activations, like sequence-parallel norms) are summed first, so every later step sees the weight's
own placement.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from titanlite.components.muon import Muon, muon_parameters
from titanlite.components.torch_private import set_last_lrs
from titanlite.config import LRScheduler, Optimizer


class Optimizers:
    """The optimizers of each model part (the whole model, or each local pipeline stage), stepped together: an
    AdamW, or with optimizer.name = "Muon" an AdamW and a Muon (titanlite/components/muon.py) over the part's
    other parameters and its hidden matrices.

    Optimizers per part keep each part's optimizer state addressable by that part's parameter names, which is
    what layout-independent checkpoints are keyed by (`by_part`: the part's optimizers, saved as one)."""

    def __init__(self, model_parts: list[nn.Module], cfg: Optimizer, device_type: str, skip_nonfinite: bool = False):
        self.model_parts = model_parts
        impl = implementation(cfg, device_type, skip_nonfinite)
        self.by_part = [build_part_optimizers(part, cfg, impl, device_type) for part in model_parts]
        self.optimizers = [optimizer for part in self.by_part for optimizer in part]

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizers[0].param_groups

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)

    def settings(self) -> list[list[dict]]:
        """Every param group's settings but its parameters and learning rate (which the schedule sets): what
        the config built, to be restored over a checkpoint's (restore_settings)."""
        return [
            [{k: v for k, v in g.items() if k not in ("params", "lr")} for g in o.param_groups] for o in self.optimizers
        ]

    def restore_settings(self, settings: list[list[dict]]) -> None:
        """After loading a checkpoint's optimizer state, whose param groups carry the settings it was saved with
        (weight decay, betas, eps, kernel), put back those of this run's config."""
        for optimizer, groups in zip(self.optimizers, settings):
            for group, values in zip(optimizer.param_groups, groups):
                group.update(values)

    def skip_update_if(self, bad: torch.Tensor) -> None:
        """Make the next step() a no-op on the device where `bad` (a bool scalar tensor) is true: the
        fused AdamW leaves weights, moments and step counts as they were, Muon its weights and momenta. No host
        synchronisation."""
        found_inf = bad.float()
        for optimizer in self.optimizers:
            optimizer.found_inf = found_inf  # type: ignore[attr-defined]  # Adam.step reads it by getattr; not in the stubs


def implementation(cfg: Optimizer, device_type: str, skip_nonfinite: bool = False) -> str:
    """'auto' is the fused kernel on CUDA, and wherever non-finite steps are skipped (only the fused
    kernel can skip an update on the device); foreach on the CPU otherwise."""
    if cfg.implementation != "auto":
        return cfg.implementation
    return "fused" if device_type == "cuda" or skip_nonfinite else "foreach"


def muon_ns_dtype(cfg: Optimizer, device_type: str) -> str:
    """optimizer.muon_ns_dtype resolved: 'auto' is bfloat16 on CUDA (torch.optim.Muon's), float32 elsewhere (the CPU
    computes in float32 throughout, and there layouts give one process's losses to float32's reduction order)."""
    if cfg.muon_ns_dtype != "auto":
        return cfg.muon_ns_dtype
    return "bfloat16" if device_type == "cuda" else "float32"


def build_part_optimizers(
    part: nn.Module, cfg: Optimizer, impl: str, device_type: str = "cpu"
) -> list[torch.optim.Optimizer]:
    """One part's optimizers: its AdamW first (whose first group's LR the logs show), then its Muon, if any."""
    params = [p for p in part.parameters() if p.requires_grad]
    if cfg.name == "AdamW":
        return [build_adamw(params, cfg, impl)]
    matrices = [p for _, p in muon_parameters(part, cfg.muon_params)]
    chosen = {id(p) for p in matrices}
    rest = [p for p in params if id(p) not in chosen]
    optimizers: list[torch.optim.Optimizer] = [build_adamw(rest, cfg, impl)] if rest else []
    if matrices:
        optimizers.append(
            Muon(
                matrices,
                lr=cfg.muon_lr,
                weight_decay=cfg.muon_weight_decay,
                momentum=cfg.muon_momentum,
                nesterov=cfg.muon_nesterov,
                ns_steps=cfg.muon_ns_steps,
                adjust_lr=cfg.muon_adjust_lr,
                ns_dtype=muon_ns_dtype(cfg, device_type),
                orthogonalize_on=cfg.muon_orthogonalize_on,
            )
        )
    return optimizers


def describe_muon(model: nn.Module, cfg: Optimizer, device_type: str) -> str:
    """The start-up line of a Muon run: which parameters each optimizer steps, and at what learning rate."""
    matrices = muon_parameters(model, cfg.muon_params)
    n_muon = sum(p.numel() for _, p in matrices)
    n_all = sum(p.numel() for p in model.parameters() if p.requires_grad)
    which = "optimizer.muon_params" if cfg.muon_params else "the blocks' linear weights and experts' matrices"
    ns = muon_ns_dtype(cfg, device_type)
    return (
        f"  optimizer: Muon on {len(matrices)} tensors ({which}; {n_muon:,} parameters) at muon_lr {cfg.muon_lr:g} "
        f"adjusted '{cfg.muon_adjust_lr}', {cfg.muon_ns_steps} Newton-Schulz steps in {ns}; AdamW on"
        f" the other {n_all - n_muon:,} (embeddings, head, routers, norms, biases) at lr {cfg.lr:g}"
    )


def build_adamw(params: list[nn.Parameter], cfg: Optimizer, impl: str) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices and embeddings only; built after sharding so its state is sharded too.

    Sharded (DTensor) and plain parameters go in groups of their own: the foreach and fused kernels take one list
    of either kind per group, and a layout can hold both (tensor parallelism alone splits the attention into
    DTensors and leaves a mixture of experts' blocks whole, plain). Checkpoints keep each parameter's group settings
    under its name (flattened), so the grouping may differ between the layout that saved and the one that loads."""
    groups = []
    for weight_decay, of_group in ((cfg.weight_decay, lambda p: p.ndim >= 2), (0.0, lambda p: p.ndim < 2)):
        for sharded in (True, False):
            members = [p for p in params if of_group(p) and isinstance(p, DTensor) == sharded]
            if members:
                groups.append({"params": members, "weight_decay": weight_decay})
    return torch.optim.AdamW(
        groups,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        fused=impl == "fused",
        foreach=impl == "foreach",
    )


def lr_factor(step: int, cfg: LRScheduler, total_steps: int) -> float:
    """Multiplier of the peak LR for optimizer step `step` (0-based): linear warm-up, then a decay from the
    peak at the first step after warm-up to exactly min_lr_factor at the last step (`total_steps - 1`)."""
    warmup = min(cfg.warmup_steps, total_steps)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if cfg.decay_type == "constant":
        return 1.0
    last = total_steps - 1  # the last step's LR is the floor: a decay that ends one step later never reaches it
    progress = 1.0 if last <= warmup else min((step - warmup) / (last - warmup), 1.0)
    if cfg.decay_type == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_factor + (1.0 - cfg.min_lr_factor) * shape


def warmup_cut(cfg: LRScheduler, total_steps: int) -> str | None:
    """The start-up line that says the warm-up is cut to the run's length (lr_factor's min), or None."""
    if cfg.warmup_steps <= total_steps:
        return None
    return (
        f"  lr schedule: lr_scheduler.warmup_steps {cfg.warmup_steps} is longer than training.steps {total_steps}: "
        f"the warm-up is cut to {total_steps} steps, the LR rising to {total_steps}/{total_steps + 1} of optimizer.lr "
        "at the last step, with no decay"
    )


class LRSchedulers:
    """The same warm-up/decay schedule on every optimizer of an Optimizers; its state is one step count."""

    def __init__(self, optimizers: Optimizers, cfg: LRScheduler, total_steps: int):
        self.schedulers = [
            torch.optim.lr_scheduler.LambdaLR(o, lambda step: lr_factor(step, cfg, total_steps))
            for o in optimizers.optimizers
        ]

    def step(self) -> None:
        for scheduler in self.schedulers:
            scheduler.step()

    def state_dict(self) -> dict:
        return self.schedulers[0].state_dict()

    def load_state_dict(self, state: dict) -> None:
        for scheduler in self.schedulers:
            scheduler.load_state_dict(state)

    def peak_lrs(self) -> list[list[float | torch.Tensor]]:
        """Each schedule's base (peak) learning rates: the config's optimizer.lr (and muon_lr)."""
        return [list(scheduler.base_lrs) for scheduler in self.schedulers]

    def resume(self, peak_lrs: list[list[float | torch.Tensor]]) -> None:
        """After a checkpoint's schedule state (its step count) is loaded, keep this run's peak LR and schedule
        (warm-up, decay, length) and set every group's LR for the current step now: a changed optimizer.lr or
        lr_scheduler setting takes effect from the first resumed step, not one step later."""
        for scheduler, peaks in zip(self.schedulers, peak_lrs):
            scheduler.base_lrs = list(peaks)
            lrs = [peak * factor(scheduler.last_epoch) for peak, factor in zip(peaks, scheduler.lr_lambdas)]
            for group, lr in zip(scheduler.optimizer.param_groups, lrs):
                group["lr"] = lr
            set_last_lrs(scheduler, lrs)


@torch.no_grad()
def clip_grad_norm_(
    params: list[nn.Parameter],
    max_norm: float,
    *,
    norm_params: list[nn.Parameter] | None = None,
    pp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Global L2 norm of all gradients (clipped to max_norm when > 0); returns the norm before clipping.

    With sharded gradients each rank holds part of each gradient: the per-tensor norms are DTensors
    whose full value needs a reduction over the mesh, which `full_tensor()` performs (total_grad_norm, mesh
    by mesh). Under pipeline parallelism each rank holds only its stages, so the squared norms are also summed
    over `pp_group`. `norm_params` leaves out copies that would be counted twice (a tied embedding split across
    stages).
    """
    reduce_partial_grads(params)
    total = total_grad_norm([p for p in (params if norm_params is None else norm_params) if p.grad is not None])
    if pp_group is not None:
        total = total**2
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_group)
        total = total.sqrt()
    if max_norm > 0:
        by_mesh = by_grad_mesh([p for p in params if p.grad is not None])
        # DTensor refuses one foreach multiply over several meshes: each mesh's gradients take the same factor.
        for group in [params] if len(by_mesh) <= 1 else by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total


def total_grad_norm(params: list[nn.Parameter]) -> torch.Tensor:
    """The L2 norm of the gradients of `params` as one vector: a plain tensor, the same on every rank.

    DTensor takes a norm over one mesh only (and never over DTensors and plain tensors together), so with
    several meshes (expert parameters on their own) each mesh's gradients give one norm, made full over that
    mesh, and these combine in float32 as torch combines per-tensor norms. On one mesh (every layout without
    experts) it is torch's own computation over all of them, so the norm stays bitwise what it was."""
    by_mesh = by_grad_mesh(params)
    if len(by_mesh) <= 1:
        return full_value(torch.nn.utils.get_total_norm(grads_of(params), norm_type=2.0, foreach=True))
    norms = [
        full_value(torch.nn.utils.get_total_norm(grads_of(group), norm_type=2.0, foreach=True))
        for group in by_mesh.values()
    ]
    return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device, torch.float32) for n in norms]), 2.0)


def grads_of(params: list[nn.Parameter]) -> list[torch.Tensor]:
    """The gradients of `params`, each of which has one."""
    return [p.grad for p in params if p.grad is not None]


def full_value(norm: torch.Tensor) -> torch.Tensor:
    """A norm computed over DTensors reduced to its full value (a plain tensor); a plain tensor as it is."""
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def by_grad_mesh(params: list[nn.Parameter]) -> dict[DeviceMesh | None, list[nn.Parameter]]:
    """`params` (each with a gradient) by their gradient's mesh, in first-seen order; plain gradients under None.
    Placements may differ within a mesh (TP's Shard(0), Shard(1), Replicate): DTensor's norm takes them together."""
    groups: dict[DeviceMesh | None, list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    return groups


_PARTIAL_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@torch.no_grad()
def reduce_partial_grads(params: list[nn.Parameter]) -> None:
    """Sum each pending partial gradient over its mesh dimension, one all-reduce per dimension for all of them.

    A weight replicated over tensor parallelism but applied to sequence- or head-sharded activations (the
    SequenceParallel norms, per-head Q/K norms) gets a Partial(sum) gradient: each rank holds its
    tokens' share. Left partial, later in-place ops depend on the torch release: on torch 2.11 clipping's
    in-place `_foreach_mul_` left those gradients unscaled, so unclipped (TP x 2 drifted from one
    process from step 3); AdamW then all-reduced them twice per step. Summed here they are plain replicated
    gradients like every other.
    """
    pending: dict[tuple, list[tuple[nn.Parameter, DTensor]]] = {}
    for p in params:
        grad = p.grad
        if isinstance(grad, DTensor) and any(placement.is_partial() for placement in grad.placements):
            pending.setdefault((grad.device_mesh, grad.placements), []).append((p, grad))
    for (mesh, placements), group in pending.items():
        locals_ = [grad.to_local() for _, grad in group]
        flat = torch.cat([t.reshape(-1) for t in locals_])
        settled = list(placements)
        for dim, placement in enumerate(placements):
            if placement.is_partial():
                # gloo has no AVG: sum, then divide. DTensor's other partials are max and min.
                op = _PARTIAL_OPS[placement.reduce_op]
                dist.all_reduce(flat, op=op, group=mesh.get_group(dim))
                if placement.reduce_op == "avg":
                    flat /= mesh.size(dim)
                settled[dim] = Replicate()
        for (p, grad), summed in zip(group, flat.split([t.numel() for t in locals_])):
            p.grad = DTensor.from_local(
                summed.view_as(grad.to_local()), mesh, settled, shape=grad.shape, stride=grad.stride()
            )
