"""Parallel degrees → one DeviceMesh with named dimensions, checked before any process group exists.

Dimensions, outermost first: pp, dp_replicate, dp_shard, cp, tp; degrees of 1 are left out of the mesh.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titanlite.base.errors import ConfigError
from titanlite.config import Parallelism

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    world_size: int
    cp: int = 1
    tp: int = 1
    pp: int = 1
    fsdp_single_rank: bool = False  # FSDP on a one-rank data-parallel mesh (a single device)

    @classmethod
    def from_config(cls, cfg: Parallelism, world_size: int, cpu_offload: bool = False) -> ParallelDims:
        """Resolve dp_shard = -1 and check that the degrees multiply to the world size; a single device
        gets a one-rank FSDP mesh when parallelism.fsdp_single_rank or CPU offload asks for it."""
        replicate, shard = cfg.data_parallel_replicate_degree, cfg.data_parallel_shard_degree
        tp, pp, cp = cfg.tensor_parallel_degree, cfg.pipeline_parallel_degree, cfg.context_parallel_degree
        named = (
            ("data_parallel_replicate_degree", replicate),
            ("context_parallel_degree", cp),
            ("tensor_parallel_degree", tp),
            ("pipeline_parallel_degree", pp),
        )
        for name, degree in named:
            if degree < 1:
                raise ConfigError(f"parallelism.{name}={degree} must be at least 1")
        for name, degree in named:
            if world_size % degree:
                raise ConfigError(
                    f"parallelism.{name}={degree} does not divide the world size {world_size}; "
                    f"use one of {_divisors(world_size)}"
                )
        others = replicate * cp * tp * pp
        if shard == -1:
            if world_size % others:
                raise ConfigError(
                    f"parallelism degrees replicate {replicate} x cp {cp} x tp {tp} x pp {pp} = {others} do not "
                    f"divide the world size {world_size}"
                )
            shard = world_size // others
        product = shard * others
        if product != world_size:
            raise ConfigError(
                f"parallelism degrees multiply to {product} (pp {pp} x replicate {replicate} x shard {shard} x cp "
                f"{cp} x tp {tp}) "
                f"but the world size is {world_size}; set parallelism.data_parallel_shard_degree = -1 or "
                f"make the product equal {world_size}"
            )
        single_rank = (cfg.fsdp_single_rank or cpu_offload) and world_size == 1
        if cfg.fsdp_single_rank and world_size > 1:
            raise ConfigError(
                f"parallelism.fsdp_single_rank is for a single-device run, but the world size is {world_size} "
                "(FSDP shards over data_parallel_shard_degree there); set it to false"
            )
        return cls(
            dp_replicate=replicate,
            dp_shard=shard,
            cp=cp,
            tp=tp,
            pp=pp,
            world_size=world_size,
            fsdp_single_rank=single_rank,
        )

    @property
    def degrees(self) -> dict[str, int]:
        return {
            "pp": self.pp,
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "cp": self.cp,
            "tp": self.tp,
        }

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different slices of each global batch are read."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP shards over dp_shard x cp: context-parallel ranks hold the same parameters, so they shard
        them (and average their gradients) like data-parallel ones."""
        return self.dp_shard > 1 or self.cp > 1 or self.fsdp_single_rank

    @property
    def ddp_enabled(self) -> bool:
        """Plain replication (DDP) only when nothing shards; replicate x shard is HSDP, done by FSDP."""
        return self.dp_replicate > 1 and self.dp_shard == 1 and self.cp == 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    def describe(self) -> str:
        used = [f"{name} {deg}" for name, deg in self.degrees.items() if deg > 1]
        if self.fsdp_single_rank:
            return "single device (FSDP on one rank)"
        return " x ".join(used) if used else "single device"

    def build_mesh(self, device_type: str) -> Mesh | None:
        """One DeviceMesh over the dimensions in use, plus the flattened views the trainer needs."""
        names = [n for n in MESH_ORDER if self.degrees[n] > 1 or (n == "dp_shard" and self.fsdp_single_rank)]
        if not names:
            return None
        root = init_device_mesh(device_type, tuple(self.degrees[n] for n in names), mesh_dim_names=tuple(names))
        # dp: which rank reads which data; dp_shard_cp: what FSDP shards over; dp_cp: what the loss averages over.
        views = {}
        for view, parts in (
            ("dp", ("dp_replicate", "dp_shard")),
            ("dp_shard_cp", ("dp_shard", "cp")),
            ("dp_cp", ("dp_replicate", "dp_shard", "cp")),
        ):
            used = tuple(n for n in parts if n in names)
            if used:
                views[view] = root[used]._flatten(view)
        return Mesh(root, views)


@dataclass(frozen=True)
class Mesh:
    """The root DeviceMesh and its flattened views; `mesh["dp"]` or `mesh[("dp_replicate", "dp_shard")]`."""

    root: DeviceMesh
    views: dict

    def __getitem__(self, names):
        return self.views[names] if isinstance(names, str) and names in self.views else self.root[names]

    def __contains__(self, name: str) -> bool:
        return name in self.views or name in (self.root.mesh_dim_names or ())


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
