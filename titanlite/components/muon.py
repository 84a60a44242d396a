"""Muon (K. Jordan et al., 2024; the update scale of Moonshot's "Muon is Scalable for LLM Training", 2025): each
hidden matrix's momentum orthogonalised by a Newton-Schulz iteration before it is applied. A stack of experts'
matrices [E, A, B] is E matrices, each orthogonalised on its own. `muon_parameters` says which parameters it steps
(the rest go to AdamW, titanlite/components/optim.py).

On one device (plain tensors) a 2-D parameter's update is torch.optim.Muon's, to the bit: the momentum as torch keeps
it (an exponential average, B <- mu B + (1 - mu) g; Nesterov's update (1 - mu) g + mu B), the iteration in bfloat16 on
the wide orientation of the matrix, scaled to a Frobenius norm of at most 1, decoupled weight decay, and the learning
rate adjusted by the matrix's shape ("original": sqrt(max(1, A / B)); "match_rms_adamw": 0.2 sqrt(max(A, B))).
Where they differ: torch refuses a tensor of more than 2 dimensions; here one of [E, A, B] is E matrices of A x B,
and its learning rate is adjusted by A x B (torch's rule reads the first two dimensions). torch has no
skip_update_if (found_inf); here a step with found_inf = 1 leaves weights and momenta as they were.

Sharded parameters (DTensors: FSDP, TP, EP and their products): the momentum is kept and updated shard by shard;
the update is made whole over every mesh dimension that splits a matrix and each rank keeps its shard of the result.
orthogonalize_on = "owner" (the default) hands each matrix whole to one rank, in rounds of one matrix per rank, by
all-to-all there and back (owner_orthogonalized); "every_rank", and a matrix split over two mesh dimensions either
way, all-gathers it and orthogonalises it on every rank that shares it (orthogonalized_shard). Both give the same
bits. A stack's expert dimension is never gathered: each rank orthogonalises the experts it holds (EP's Shard(0), and
FSDP's Shard(0) of the local experts). docs/optimizers.md has the measured bytes and times of the two ways."""

from __future__ import annotations

import math
from fnmatch import fnmatchcase
from typing import cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from titanlite.base.errors import ConfigError
from titanlite.models.common.moe.layer import GroupedExperts, Router

NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)
ADJUSTMENTS = ("original", "match_rms_adamw", "none")
NS_DTYPES = ("bfloat16", "float32")
ORTHOGONALIZE_ON = ("owner", "every_rank")


def orthogonalize(
    update: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float, dtype: str = "bfloat16"
) -> Tensor:
    """The Newton-Schulz iteration's near-orthogonal matrix of the 2-D `update` (U S' V^T with S' about 1 where
    update = U S V^T), in `dtype` (torch.optim.Muon's is bfloat16): the quintic a X + b (X X^T) X + c (X X^T)^2 X,
    `steps` times, from the matrix in its wide orientation divided by its Frobenius norm (at least eps)."""
    a, b, c = coefficients
    x = update.to(getattr(torch, dtype))
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, rows: int, cols: int, adjustment: str) -> float:
    """The learning rate of a rows x cols matrix's orthogonalised update."""
    if adjustment == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjustment == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


class Muon(torch.optim.Optimizer):
    """Muon over matrices (2-D) and stacks of them (3-D: experts); see the module docstring."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr: str = "original",
        ns_dtype: str = "bfloat16",
        orthogonalize_on: str = "owner",
    ):
        if adjust_lr not in ADJUSTMENTS:
            raise ValueError(f"Muon adjust_lr={adjust_lr!r}; use one of {', '.join(ADJUSTMENTS)}")
        if not 0 <= momentum < 1:
            raise ValueError(f"Muon momentum={momentum}; it must be in [0, 1)")
        if orthogonalize_on not in ORTHOGONALIZE_ON:
            raise ValueError(f"Muon orthogonalize_on={orthogonalize_on!r}; use one of {', '.join(ORTHOGONALIZE_ON)}")
        if ns_dtype not in NS_DTYPES:
            raise ValueError(f"Muon ns_dtype={ns_dtype!r}; use one of {', '.join(NS_DTYPES)}")
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=ns_coefficients,
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr=adjust_lr,
            ns_dtype=ns_dtype,
            orthogonalize_on=orthogonalize_on,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim not in (2, 3):
                    raise ValueError(
                        f"Muon orthogonalises matrices and stacks of them; a parameter of shape {tuple(p.shape)} "
                        "belongs with AdamW"
                    )

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)  # set by Optimizers.skip_update_if, as fused AdamW reads it
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for bucket in buckets(params, group["orthogonalize_on"]):
                updates = [self.momentum_update(p, group, found_inf) for p in bucket]
                for p, ortho in zip(bucket, orthogonalized_shards(bucket, updates, group)):
                    self.apply(p, ortho, group, found_inf)
        return loss

    def momentum_update(self, p: Tensor, group: dict, found_inf: Tensor | None) -> Tensor:
        """Update p's momentum (this rank's shard of it) and return the shard of the update to orthogonalise; with
        found_inf (a scalar, 1.0 for a bad step) the momentum is kept where it is 1, decided on the device."""
        momentum = group["momentum"]
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        grad = cast(Tensor, p.grad)  # step() passes only parameters with a gradient
        if isinstance(grad, DTensor) and isinstance(p, DTensor) and grad.placements != p.placements:
            grad = grad.redistribute(p.device_mesh, p.placements)  # a pending Partial sum, or another layout
        buf, g = local(state["momentum_buffer"]), local(grad)
        if found_inf is None:
            buf.lerp_(g, 1 - momentum)
        else:
            buf.copy_(torch.where(found_inf.to(buf.device).bool(), buf, buf.lerp(g, 1 - momentum)))
        return g.lerp(buf, momentum) if group["nesterov"] else buf

    def apply(self, p: Tensor, ortho: Tensor, group: dict, found_inf: Tensor | None) -> None:
        """Decoupled weight decay and the orthogonalised update on this rank's shard of p (kept where found_inf
        is 1)."""
        lr = group["lr"]
        weight = local(p)
        rows, cols = p.shape[-2:]
        alpha = -adjusted_lr(lr, rows, cols, group["adjust_lr"])
        if found_inf is None:
            weight.mul_(1 - lr * group["weight_decay"])
            weight.add_(ortho, alpha=alpha)
        else:
            stepped = weight.mul(1 - lr * group["weight_decay"]).add_(ortho, alpha=alpha)
            weight.copy_(torch.where(found_inf.to(weight.device).bool(), weight, stepped))


def buckets(params: list[Tensor], orthogonalize_on: str) -> list[list[Tensor]]:
    """The parameters in the groups that are orthogonalised together: with orthogonalize_on = "owner", the
    DTensors whose matrices one mesh dimension of n ranks splits (owner_split), by mesh, placements and shape, in
    order of first appearance (the same on every rank), n at a time (one for each rank to own: the step holds one
    round's matrices whole, not all of a shape's); every other parameter alone."""
    if orthogonalize_on != "owner":
        return [[p] for p in params]
    groups: dict[tuple, list[Tensor]] = {}
    rounds: list[list[Tensor]] = []
    for p in params:
        split = owner_split(p) if isinstance(p, DTensor) else None
        if split is None or not isinstance(p, DTensor):
            rounds.append([p])
            continue
        key = (p.device_mesh, tuple(p.placements), tuple(p.shape))
        group = groups.setdefault(key, [])
        if not group:
            rounds.append(group)
        group.append(p)
        if len(group) == p.device_mesh.size(split):  # a full round: the next of this shape starts another
            del groups[key]
    return rounds


def owner_split(p: DTensor) -> int | None:
    """The mesh dimension that splits p's matrices, where it is the only one and a plain Shard (FSDP alone, TP
    alone, HSDP, EP's experts with FSDP over their rows), and every other one replicates p or holds whole matrices
    of it (EP's experts); None otherwise (FSDP x TP: the all-gather way)."""
    target = whole_matrix_placements(p)
    split = [i for i, (now, whole) in enumerate(zip(p.placements, target)) if now != whole]
    if len(split) != 1 or type(p.placements[split[0]]) is not Shard:
        return None
    if any(not (pl.is_replicate() or type(pl) is Shard) for pl in p.placements):
        return None
    return split[0]


def orthogonalized_shards(params: list[Tensor], updates: list[Tensor], group: dict) -> list[Tensor]:
    """The orthogonalised updates of this rank's shards of `params` (a bucket), from this rank's shards of their
    updates."""
    if len(params) == 1 and (group["orthogonalize_on"] != "owner" or not isinstance(params[0], DTensor)):
        return [orthogonalized_shard(params[0], updates[0], group)]
    if not isinstance(params[0], DTensor) or owner_split(params[0]) is None:
        return [orthogonalized_shard(p, u, group) for p, u in zip(params, updates)]
    return owner_orthogonalized(cast(list[DTensor], params), updates, group)


def owner_orthogonalized(params: list[DTensor], updates: list[Tensor], group: dict) -> list[Tensor]:
    """K matrices (or stacks) of one shape and layout, split along tensor dim d by one mesh dimension of n ranks:
    matrix k belongs to rank k mod n. One all-to-all hands each owner the other ranks' shards of its matrices, it
    orthogonalises them whole, and a second all-to-all returns every rank its shards of the results, in the
    iteration's dtype (bfloat16: half the bytes; sent as raw bytes, bit for bit). Each rank sends about 2 (n - 1) / n^2
    of the K matrices where an all-gather of each sends (n - 1) / n of them, and runs K / n of the iterations rather
    than K. (DTensor's own Shard-to-Shard redistribution falls back to an all-gather on gloo.)"""
    p0 = params[0]
    mesh, split = p0.device_mesh, cast(int, owner_split(p0))
    process_group, n, me = mesh.get_group(split), mesh.size(split), mesh.get_local_rank(split)
    d = cast(Shard, p0.placements[split]).dim
    whole = p0.shape[d]
    chunk = -(-whole // n)
    sizes = [max(0, min(whole, (r + 1) * chunk) - r * chunk) for r in range(n)]  # torch.chunk's, as DTensor's
    shapes = [list(updates[0].shape[:d]) + [sizes[r]] + list(updates[0].shape[d + 1 :]) for r in range(n)]
    numels = [math.prod(shape) for shape in shapes]
    owned = [[k for k in range(len(params)) if k % n == o] for o in range(n)]
    # To each owner, this rank's shards of its matrices; from each rank, its shards of this rank's.
    send = torch.cat([updates[k].reshape(-1) for o in range(n) for k in owned[o]])
    received = send.new_empty(len(owned[me]) * sum(numels))
    dist.all_to_all_single(
        received,
        send,
        [len(owned[me]) * numels[r] for r in range(n)],
        [len(owned[o]) * numels[me] for o in range(n)],
        group=process_group,
    )
    pieces = received.split([len(owned[me]) * numels[r] for r in range(n)])
    by_rank = [piece.split(numels[r]) for r, piece in enumerate(pieces)]
    rows, cols = p0.shape[-2:]
    ns = group["ns_coefficients"], group["ns_steps"], group["eps"], group["ns_dtype"]
    results = []
    for j in range(len(owned[me])):
        matrix = torch.cat([by_rank[r][j].view(shapes[r]) for r in range(n)], dim=d)
        results.append(orthogonalize_matrices(matrix, rows, cols, *ns))
    dtype = getattr(torch, group["ns_dtype"])
    size = dtype.itemsize  # sent as bytes: gloo has no bfloat16 (nor int16); the bits travel as they are
    offsets = [sum(sizes[:r]) for r in range(n)]
    back = [res.narrow(d, offsets[r], sizes[r]).reshape(-1) for r in range(n) for res in results]
    send_back = torch.cat(back).view(torch.uint8) if back else torch.empty(0, dtype=torch.uint8, device=send.device)
    returned = torch.empty(
        sum(len(owned[o]) for o in range(n)) * numels[me] * size, dtype=torch.uint8, device=send.device
    )
    dist.all_to_all_single(
        returned,
        send_back,
        [len(owned[o]) * numels[me] * size for o in range(n)],
        [len(owned[me]) * numels[r] * size for r in range(n)],
        group=process_group,
    )
    shards: list[Tensor] = [send] * len(params)  # placeholders, each replaced below
    flat = returned.view(dtype).split(numels[me])
    for index, k in enumerate(k for o in range(n) for k in owned[o]):
        shards[k] = flat[index].view(shapes[me])
    return shards


def local(t: Tensor) -> Tensor:
    """This rank's shard of a DTensor (a view: in-place changes reach the DTensor), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def whole_matrix_placements(p: DTensor) -> list[Placement]:
    """p's placements with every split of a matrix gathered: what is left sharded is only a stack's expert
    dimension (dim 0 of a 3-D parameter), whose matrices are each whole on one rank."""
    stack = p.ndim == 3
    return [pl if stack and pl.is_shard() and getattr(pl, "dim", None) == 0 else Replicate() for pl in p.placements]


def orthogonalized_shard(p: Tensor, update: Tensor, group: dict) -> Tensor:
    """The orthogonalised update of this rank's shard of p, from this rank's shard of the update: each matrix made
    whole (an all-gather over the mesh dimensions that split it), orthogonalised on every rank that shares it, and
    cut back to the shard."""
    rows, cols = p.shape[-2:]
    ns = group["ns_coefficients"], group["ns_steps"], group["eps"], group["ns_dtype"]
    if not isinstance(p, DTensor):
        return orthogonalize_matrices(update, rows, cols, *ns)
    mesh, target = p.device_mesh, whole_matrix_placements(p)
    sharded = DTensor.from_local(update, mesh, p.placements, shape=p.shape, stride=p.stride())
    whole = sharded.redistribute(mesh, target).to_local() if list(p.placements) != target else update
    ortho = orthogonalize_matrices(whole, rows, cols, *ns)
    if list(p.placements) == target:
        return ortho
    return (
        DTensor.from_local(ortho, mesh, target, shape=p.shape, stride=p.stride())
        .redistribute(mesh, p.placements)
        .to_local()
    )


def orthogonalize_matrices(
    update: Tensor, rows: int, cols: int, coefficients: tuple[float, float, float], steps: int, eps: float, dtype: str
) -> Tensor:
    """Each rows x cols matrix of `update` (one matrix, or a stack of them) orthogonalised on its own."""
    if update.ndim == 2:
        return orthogonalize(update, coefficients, steps, eps, dtype)
    matrices = update.reshape(-1, rows, cols)
    if not len(matrices):  # a rank that owns none of a bucket's matrices
        return update.to(getattr(torch, dtype))
    return torch.stack([orthogonalize(m, coefficients, steps, eps, dtype) for m in matrices]).reshape(update.shape)


def unwrapped_name(name: str) -> str:
    """A parameter's name as the plain model has it (without activation checkpointing's or torch.compile's wrapper
    modules), the name muon_params matches and checkpoints keep."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def muon_parameters(model: nn.Module, globs: list[str]) -> list[tuple[str, nn.Parameter]]:
    """The (name, parameter) pairs Muon steps. With `globs` (optimizer.muon_params), those whose names match one;
    without, the hidden matrices: every linear weight and stack of experts' matrices inside the blocks (`layers.`),
    but not the routers' gates. The embeddings and the output head stay with AdamW (as Keller Jordan's Muon and
    Moonlight's do); so do the routers: a gate of n_experts x dim orthogonalised gets every expert's score direction
    the same push whatever its gradient's size, and it is a small fraction of the parameters (Moonlight's example
    hands it to Muon; name it in muon_params to do so)."""
    if globs:
        return [
            (name, p)
            for name, p in model.named_parameters()
            if p.requires_grad and any(fnmatchcase(unwrapped_name(name), glob) for glob in globs)
        ]
    chosen = []
    routers = {unwrapped_name(n) + "." for n, m in model.named_modules() if isinstance(m, Router)}
    for module_name, module in model.named_modules():
        name = unwrapped_name(module_name)
        if not name.startswith("layers.") or any(name.startswith(r) or name + "." == r for r in routers):
            continue
        if isinstance(module, GroupedExperts):
            chosen += [(f"{module_name}.{n}", p) for n, p in module.named_parameters(recurse=False) if p.ndim == 3]
        elif isinstance(module, nn.Linear):
            chosen.append((f"{module_name}.weight", cast(nn.Parameter, module.weight)))
    return [(n, p) for n, p in chosen if p.requires_grad]


def check_muon_params(model: nn.Module, globs: list[str]) -> None:
    """Refuse a muon_params glob that names a parameter Muon cannot orthogonalise (a vector) or names none."""
    names = [unwrapped_name(n) for n, _ in model.named_parameters()]
    for glob in globs:
        if not any(fnmatchcase(n, glob) for n in names):
            raise ConfigError(
                f"optimizer.muon_params glob '{glob}' matches no parameter of the model (e.g. '{names[0]}'); "
                "fix or remove it"
            )
    for name, p in muon_parameters(model, globs):
        if p.ndim < 2:
            raise ConfigError(
                f"optimizer.muon_params names {unwrapped_name(name)} of shape {tuple(p.shape)}, which Muon cannot "
                "orthogonalise (it steps matrices and stacks of them); narrow the globs so that vectors (norms, "
                "biases) stay with AdamW"
            )
