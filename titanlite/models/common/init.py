"""Weight initialisation that does not depend on the layout, and filling a (sharded) model one full
parameter at a time: the fresh weights of a run, and the weights read from a Hugging Face folder."""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from titanlite.models.common.interface import DecoderModule


def param_seed(seed: int, name: str) -> int:
    """Seed for parameter `name`'s generator: stable across processes (unlike hash()) and layouts."""
    return (zlib.crc32(name.encode()) ^ (seed * 1_000_003)) & ((1 << 63) - 1)


def canonical_name(name: str) -> str:
    """A parameter's name without the components activation checkpointing and compile insert, so that
    they do not change which generator seeds it."""
    for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(wrapper, "")
    return name


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
def fill_parameters(model: nn.Module, full_value: Callable[[str, nn.Parameter], torch.Tensor]) -> None:
    """Set each parameter from `full_value(name, param)`, its full (unsharded) value, one at a time: a
    sharded parameter keeps only its own slice, so no rank ever holds more than one full parameter."""
    for wrapped_name, param in model.named_parameters():
        full = full_value(canonical_name(wrapped_name), param)
        if isinstance(param, DTensor):
            # src_data_rank=None: every rank holds the same full tensor and slices it locally, no communication.
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(local)  # across devices under offload
        else:
            param.copy_(full)
