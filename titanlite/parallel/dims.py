"""Parallel degrees → one DeviceMesh with named dimensions, checked before any process group exists.

MESH_DIMS is the one description of the layout: the checks, the mesh and its flattened views, and the
planner's layouts and their command-line overrides all derive from it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titanlite.base.errors import ConfigError
from titanlite.components.torch_private import flatten_mesh
from titanlite.config import Parallelism


@dataclass(frozen=True)
class MeshDim:
    """One dimension of the mesh: its name (mesh["tp"], dims.tp), its degree's key in [parallelism] (declared,
    with its help text, in titanlite/config/sections.py), the word the degree checks' messages use for it, and
    what its ranks are for: the flattened views (VIEWS) they belong to."""

    name: str
    key: str
    label: str
    views: tuple[str, ...] = ()
    rest: bool = False  # its degree may be -1: whatever the other degrees leave of the world size


# Flattened views over several dimensions: dp, which rank reads which data; dp_shard_cp, what FSDP shards over;
# dp_cp, what the loss is averaged over.
VIEWS = ("dp", "dp_shard_cp", "dp_cp")
# The ranks a parameter is sharded over under FSDP x TP (dp_shard x cp x tp), flattened for DTensor (build_mesh).
SHARDED = "dp_shard_cp_tp"

# Outermost first; degrees of 1 are left out of the mesh. Adding a dimension: its key in sections.py, one entry
# here, then the apply_* that uses mesh[name] (docs/architecture.md).
MESH_DIMS = (
    MeshDim("pp", "pipeline_parallel_degree", "pp"),
    MeshDim("dp_replicate", "data_parallel_replicate_degree", "replicate", ("dp", "dp_cp")),
    MeshDim("dp_shard", "data_parallel_shard_degree", "shard", ("dp", "dp_shard_cp", "dp_cp"), rest=True),
    MeshDim("cp", "context_parallel_degree", "cp", ("dp_shard_cp", "dp_cp")),
    MeshDim("tp", "tensor_parallel_degree", "tp"),
)
MESH_ORDER = tuple(dim.name for dim in MESH_DIMS)
REST = next(dim for dim in MESH_DIMS if dim.rest)


def _in_config_order(dims: tuple[MeshDim, ...]) -> tuple[MeshDim, ...]:
    """The dimensions in the order [parallelism] declares their keys: the order overrides and checks name them."""
    keys = [f.name for f in fields(Parallelism)]
    undeclared = [dim.key for dim in dims if dim.key not in keys]
    if undeclared:
        raise TypeError(f"parallelism declares no {undeclared}: add the key to titanlite/config/sections.py")
    return tuple(sorted(dims, key=lambda dim: keys.index(dim.key)))


CONFIG_ORDER = _in_config_order(MESH_DIMS)


@dataclass(frozen=True)
class ParallelDims:
    """The degree of every dimension, in MESH_DIMS' order; `dims.tp`, `dims.dp_shard` read one by its name."""

    sizes: tuple[int, ...]
    fsdp_single_rank: bool = False  # FSDP on a one-rank data-parallel mesh (a single device)
    ep: int = 1  # expert parallelism: ranks borrowed from dp_shard x cp that split the routed experts
    etp: int = 1  # expert tensor parallelism: 1, or tp (each expert's matrices split over the tp ranks)

    def __post_init__(self) -> None:
        if len(self.sizes) != len(MESH_DIMS):
            raise ValueError(f"ParallelDims needs one degree per dimension {MESH_ORDER}, not {self.sizes}")

    def __getattr__(self, name: str) -> int:
        # Reached only where ordinary lookup fails: a dimension's degree, by its name in MESH_DIMS.
        if name in MESH_ORDER:
            return self.sizes[MESH_ORDER.index(name)]
        raise AttributeError(f"'ParallelDims' object has no attribute '{name}'")

    @classmethod
    def of(cls, fsdp_single_rank: bool = False, ep: int = 1, etp: int = 1, **degrees: int) -> ParallelDims:
        """The layout with these degrees, by dimension name (1 for the others): `ParallelDims.of(dp_shard=4, tp=2)`;
        `ep`, the expert-parallel degree, borrows its ranks from dp_shard x cp (check_ep); `etp`, 1 or tp, splits
        the experts' matrices over the tp ranks (check_etp)."""
        unknown = sorted(set(degrees) - set(MESH_ORDER))
        if unknown:
            raise TypeError(f"no mesh dimension {unknown}; the dimensions are {MESH_ORDER}")
        return cls(tuple(degrees.get(name, 1) for name in MESH_ORDER), fsdp_single_rank, ep, etp)

    @classmethod
    def from_config(cls, cfg: Parallelism, world_size: int, cpu_offload: bool = False) -> ParallelDims:
        """Resolve the degree of -1 and check that the degrees multiply to the world size; a single device
        gets a one-rank FSDP mesh when parallelism.fsdp_single_rank or CPU offload asks for it."""
        degrees: dict[str, int] = {dim.name: getattr(cfg, dim.key) for dim in MESH_DIMS}
        given = [dim for dim in CONFIG_ORDER if not dim.rest]
        for dim in given:
            if degrees[dim.name] < 1:
                raise ConfigError(f"parallelism.{dim.key}={degrees[dim.name]} must be at least 1")
        for dim in given:
            if world_size % degrees[dim.name]:
                raise ConfigError(
                    f"parallelism.{dim.key}={degrees[dim.name]} does not divide the world size {world_size}; "
                    f"use one of {_divisors(world_size)}"
                )
        others = math.prod(degrees[dim.name] for dim in given)
        if degrees[REST.name] == -1:
            if world_size % others:
                raise ConfigError(
                    f"parallelism degrees {_factors(given, degrees)} = {others} do not divide the world size "
                    f"{world_size}"
                )
            degrees[REST.name] = world_size // others
        product = math.prod(degrees.values())
        if product != world_size:
            raise ConfigError(
                f"parallelism degrees multiply to {product} ({_factors(MESH_DIMS, degrees)}) "
                f"but the world size is {world_size}; set parallelism.{REST.key} = -1 or "
                f"make the product equal {world_size}"
            )
        single_rank = (cfg.fsdp_single_rank or cpu_offload) and world_size == 1
        if cfg.fsdp_single_rank and world_size > 1:
            raise ConfigError(
                f"parallelism.fsdp_single_rank is for a single-device run, but the world size is {world_size} "
                "(FSDP shards over data_parallel_shard_degree there); set it to false"
            )
        check_ep(cfg.expert_parallel_degree, degrees["dp_shard"], degrees["cp"])
        check_etp(cfg.expert_tensor_parallel_degree, degrees["tp"], cfg.expert_parallel_degree, degrees["cp"])
        return cls.of(
            fsdp_single_rank=single_rank,
            ep=cfg.expert_parallel_degree,
            etp=cfg.expert_tensor_parallel_degree,
            **degrees,
        )

    @property
    def degrees(self) -> dict[str, int]:
        """Each dimension's degree by its name, outermost first."""
        return dict(zip(MESH_ORDER, self.sizes))

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    def view_degree(self, view: str) -> int:
        """The ranks in a flattened view (VIEWS): the product of its dimensions' degrees."""
        return math.prod(size for dim, size in zip(MESH_DIMS, self.sizes) if view in dim.views)

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different slices of each global batch are read."""
        return self.view_degree("dp")

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP shards over dp_shard x cp: context-parallel ranks hold the same parameters, so they shard
        them (and average their gradients) like data-parallel ones."""
        return self.view_degree("dp_shard_cp") > 1 or self.fsdp_single_rank

    @property
    def ddp_enabled(self) -> bool:
        """Plain replication (DDP) only when nothing shards; replicate x shard is HSDP, done by FSDP."""
        return self.dp_replicate > 1 and self.view_degree("dp_shard_cp") == 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def etp_enabled(self) -> bool:
        return self.etp > 1

    @property
    def efsdp(self) -> int:
        """The ranks FSDP shards each expert-parallel shard of the experts over: dp_shard x cp / ep."""
        return self.view_degree("dp_shard_cp") // self.ep

    def describe(self) -> str:
        used = [f"{name} {deg}" for name, deg in self.degrees.items() if deg > 1]
        if self.ep_enabled:
            used.append(f"ep {self.ep} (of shard x cp)")
        if self.etp_enabled:
            used.append(f"etp {self.etp} (experts split over tp)")
        if self.fsdp_single_rank:
            return "single device (FSDP on one rank)"
        return " x ".join(used) if used else "single device"

    def overrides(self, every: bool = False) -> list[str]:
        """The command-line overrides that select these degrees, in the order [parallelism] declares them; the
        expert degrees where above 1, or with `every` always (so two lists compare key by key)."""
        args = [arg for dim in CONFIG_ORDER for arg in (f"--parallelism.{dim.key}", str(self.degrees[dim.name]))]
        args += ["--parallelism.expert_parallel_degree", str(self.ep)] if self.ep_enabled or every else []
        return args + (
            ["--parallelism.expert_tensor_parallel_degree", str(self.etp)] if self.etp_enabled or every else []
        )

    def build_mesh(self, device_type: str) -> Mesh | None:
        """One DeviceMesh over the dimensions in use, plus the flattened views the trainer needs.

        With expert parallelism, dp_shard is split in two, dp_shard_mod_ep (outer) x dp_shard_in_ep (inner, ep / cp
        ranks), so that "ep" (dp_shard_in_ep x cp) and "efsdp" (dp_shard_mod_ep, what FSDP shards the experts over)
        are dimensions of one root mesh, as FSDP's 2-D sharding of the experts needs; "dp_shard" is then a view."""
        names = [n for n in MESH_ORDER if self.degrees[n] > 1 or (n == "dp_shard" and self.fsdp_single_rank)]
        if not names:
            return None
        sizes = {n: self.degrees[n] for n in names}
        split = {"dp_shard": ("dp_shard_mod_ep", "dp_shard_in_ep")} if self.ep_enabled else {}
        if split:  # both kept even at size 1: the expert meshes below always name them
            names = [part for n in names for part in split.get(n, (n,))]
            sizes["dp_shard_in_ep"] = self.ep // self.cp
            sizes["dp_shard_mod_ep"] = self.degrees["dp_shard"] // sizes["dp_shard_in_ep"]
        root = init_device_mesh(device_type, tuple(sizes[n] for n in names), mesh_dim_names=tuple(names))
        views = {}
        for view in VIEWS:
            dims = [dim.name for dim in MESH_DIMS if view in dim.views and dim.name in sizes]
            used = tuple(part for n in dims for part in split.get(n, (n,)))
            if used:
                views[view] = flatten_mesh(root[used], view)
        if self.ep_enabled:
            views["dp_shard"] = flatten_mesh(root[split["dp_shard"]], "dp_shard")
            views["ep"] = flatten_mesh(root[tuple(n for n in ("dp_shard_in_ep", "cp") if n in names)], "ep")
        if self.ep_enabled and self.etp_enabled:  # the experts' 2-D mesh: dispatched over ep, split over tp
            views["ep_tp"] = root[("dp_shard_in_ep", "tp")]  # check_etp: no cp beside EP x ETP, so ep is dp_shard_in_ep
        if self.tp_enabled and self.fsdp_enabled:
            # FSDP x TP's parameters lie on a (dp_shard_cp, tp) mesh (split experts on (dp_shard_mod_ep, ep_tp)), and a
            # norm of their gradients is partial over all of it: DTensor reduces it in one all-reduce where a flattened
            # mesh over those ranks exists (it finds one by its layout; no titanlite code reads this view), else in one
            # a dimension, warning that this is "suboptimal".
            views[SHARDED] = flatten_mesh(root[tuple(n for n in names if n not in ("pp", "dp_replicate"))], SHARDED)
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


def check_ep(ep: int, dp_shard: int, cp: int) -> None:
    """Expert parallelism borrows its ranks from dp_shard x cp: all of cp's and ep / cp of dp_shard's."""
    if ep < 1:
        raise ConfigError(f"parallelism.expert_parallel_degree={ep} must be at least 1")
    if ep == 1:
        return
    if ep % cp:
        raise ConfigError(
            f"parallelism.expert_parallel_degree={ep} must be a multiple of context_parallel_degree={cp}: "
            "expert parallelism borrows every context-parallel rank"
        )
    if dp_shard % (ep // cp):
        raise ConfigError(
            f"parallelism.expert_parallel_degree={ep} borrows its ranks from data_parallel_shard_degree x "
            f"context_parallel_degree = {dp_shard} x {cp}, which it does not divide; use a degree that divides "
            f"{dp_shard * cp} and is a multiple of {cp}"
        )


def check_etp(etp: int, tp: int, ep: int, cp: int) -> None:
    """Expert tensor parallelism splits the experts over the tensor-parallel ranks, all of them or none (as
    TorchTitan's expert_tensor_parallel_degree)."""
    if etp == 1:
        return
    if etp != tp:
        raise ConfigError(
            f"parallelism.expert_tensor_parallel_degree={etp} must be 1 (experts whole on each tensor-parallel rank) "
            f"or tensor_parallel_degree={tp} (each expert split over them); use 1" + (f" or {tp}" if tp > 1 else "")
        )
    if ep > 1 and cp > 1:
        raise ConfigError(
            f"parallelism.expert_tensor_parallel_degree={etp} beside expert_parallel_degree={ep} and "
            f"context_parallel_degree={cp} is not supported (the experts' mesh would be 3-D); set one of them to 1"
        )


def _factors(dims: Sequence[MeshDim], degrees: dict[str, int]) -> str:
    """'pp 1 x replicate 2 x shard 4': the degrees as the checks' messages name them."""
    return " x ".join(f"{dim.label} {degrees[dim.name]}" for dim in dims)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
