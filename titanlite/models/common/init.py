"""Weight initialisation that does not depend on the layout, and filling a (sharded) model one full
parameter at a time: the fresh weights of a run, and the weights read from a Hugging Face folder. Each parameter
is started by the module that holds it (start_param), from a generator of its own."""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from titanlite.models.common.init_scheme import InitScheme
from titanlite.models.common.interface import DecoderModule


def param_seed(seed: int, name: str) -> int:
    """Seed for parameter `name`'s generator: stable across processes (unlike hash()) and layouts."""
    return (zlib.crc32(name.encode()) ^ (seed * 1_000_003)) & ((1 << 63) - 1)


# The modules activation checkpointing and compile wrap a module in, by the name of the module they hold.
WRAPPERS = ("_checkpoint_wrapped_module", "_orig_mod")


def canonical_name(name: str) -> str:
    """A parameter's name without the components activation checkpointing and compile insert, so that
    they do not change which generator seeds it."""
    for wrapper in WRAPPERS:
        name = name.replace(wrapper + ".", "")
    return name


def start_param(
    model: nn.Module, name: str, full: torch.Tensor, generator: torch.Generator, scheme: InitScheme
) -> None:
    """Fill `full`, the full value of `model`'s parameter `name`, in place, drawing only from `generator`: the
    innermost module on the parameter's path that starts its own parameters does, its `init_own(local name, full,
    generator, scheme)` (the name below it, e.g. "wq.weight" for an attention), so a module's roles live with the
    module. PyTorch's own norms, which have no such method, start as `scheme.norm` says. A KeyError for a name
    `model` does not have or whose owner does not know it."""
    *path, leaf = canonical_name(name).split(".")
    chain = [_unwrapped(model)]
    for key in path:
        children = dict(chain[-1].named_children())
        if key not in children:
            raise KeyError(f"{type(model).__name__} has no parameter {name!r}")
        chain.append(_unwrapped(children[key]))
    for depth in range(len(chain) - 1, -1, -1):
        init_own = getattr(chain[depth], "init_own", None)
        if init_own is not None:
            init_own(".".join([*path[depth:], leaf]), full, generator, scheme)
            return
        if depth == len(chain) - 1 and isinstance(chain[depth], (nn.RMSNorm, nn.LayerNorm)):
            scheme.norm(leaf, full)
            return
    raise KeyError(f"no module of {type(model).__name__} starts parameter {name!r}")


def _unwrapped(module: nn.Module) -> nn.Module:
    """The module inside activation checkpointing's and compile's wrappers (WRAPPERS), or `module` itself."""
    children = dict(module.named_children())
    inner = next((children[w] for w in WRAPPERS if w in children), None)
    return module if inner is None else _unwrapped(inner)


@torch.no_grad()
def init_weights(model: DecoderModule, seed: int, device: torch.device | None = None) -> None:
    """Fill every parameter so the full weights do not depend on the layout.

    Each full parameter is generated from its own generator, seeded by the run seed and the parameter's
    name; a sharded parameter then keeps only its own slice. Seeding one stream after sharding instead
    would make the weights depend on the world size.
    """

    def initial_value(name: str, param: nn.Parameter) -> torch.Tensor:
        where = device if device is not None else param.device
        full = torch.empty(param.shape, dtype=torch.float32, device=where)
        # A pipeline's last stage holds its own copy of a tied embedding as output.weight: seed it as the
        # embedding so both copies start equal.
        tied_copy = name == "output.weight" and model.args.tie_embeddings
        seed_name = "tok_embeddings.weight" if tied_copy else name
        generator = torch.Generator(device=where).manual_seed(param_seed(seed, seed_name))
        model.init_param(name, full, generator)
        return full

    fill_parameters(model, initial_value)


@torch.no_grad()
def fill_parameters(
    model: nn.Module,
    full_value: Callable[[str, nn.Parameter], torch.Tensor],
    rows_value: Callable[[str, nn.Parameter, list[int]], torch.Tensor | None] | None = None,
) -> None:
    """Set each parameter from `full_value(name, param)`, its full (unsharded) value, one at a time: a
    sharded parameter keeps only its own slice, so no rank ever holds more than one full parameter.

    `rows_value(name, param, rows)`, where given, is asked first for a parameter sharded along its first dimension:
    the full value's rows `rows` only (the ones this rank keeps, in order), or None where it cannot read part of
    the parameter; so a rank holding some of a stack of experts reads only those."""
    for wrapped_name, param in model.named_parameters():
        name = canonical_name(wrapped_name)
        if isinstance(param, DTensor):
            part = _kept_part(name, param, rows_value) if rows_value is not None else None
            if part is not None:
                param.to_local().copy_(part)
                continue
            full = full_value(name, param)
            # src_data_rank=None: every rank holds the same full tensor and slices it locally, no communication.
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(local)  # across devices under offload
        else:
            param.copy_(full_value(name, param))


def _kept_part(name: str, param: DTensor, rows_value) -> torch.Tensor | None:
    """This rank's shard of `param` from `rows_value`'s rows of it (fill_parameters), or None."""
    rows = kept_indices(param, 0)
    part = rows_value(name, param, rows) if rows is not None else None
    if part is None or rows is None:
        return None
    if part.shape != (len(rows), *param.shape[1:]):
        raise ValueError(f"{name}: {len(rows)} rows read as {tuple(part.shape)}; the parameter is {tuple(param.shape)}")
    for dim in range(1, part.dim()):
        kept = kept_indices(param, dim)
        if kept is not None:
            part = part.index_select(dim, torch.tensor(kept, dtype=torch.long, device=part.device))
    return part


def kept_indices(param: DTensor, dim: int) -> list[int] | None:
    """The indices along dimension `dim` of the full tensor that this rank's shard of `param` holds, in order; None
    where no mesh dimension shards `dim`. (An index vector laid out as `param` lays out that dimension: uneven and
    nested shards, FSDP's strided ones over expert or tensor parallelism among them, come out as DTensor makes them.)"""
    # Shard and _StridedShard (not a Shard subclass in every torch) are the placements with a `dim`.
    placements = [_on_first(p) if getattr(p, "dim", None) == dim else Replicate() for p in param.placements]
    if all(isinstance(p, Replicate) for p in placements):
        return None
    index = torch.arange(param.shape[dim], device=param.to_local().device)
    local = distribute_tensor(index, param.device_mesh, placements, src_data_rank=None).to_local()
    return local.tolist()


def _on_first(placement: Placement) -> Placement:
    """`placement` (a Shard, or a _StridedShard with its split factor) acting on dimension 0 instead."""
    if getattr(placement, "dim", None) == 0:
        return placement
    if hasattr(placement, "split_factor"):
        return type(placement)(0, split_factor=placement.split_factor)  # type: ignore[call-arg]
    return Shard(0)
