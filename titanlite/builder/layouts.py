"""The layouts the planner weighs: a config's own, and every candidate a machine allows (single device, DDP,
ZeRO-2/3, HSDP across nodes, TP within a node, PP across nodes, CP for long sequences, EP for mixtures of experts
and ETP beside TP, CPU offload as a last resort), each with the command-line overrides that select it."""

from __future__ import annotations

from dataclasses import dataclass, replace

from titanlite.base.errors import ConfigError
from titanlite.builder.plan import ModelPlan
from titanlite.parallel.dims import ParallelDims, check_ep
from titanlite.parallel.expert_parallel import check_ep_degree, check_experts_split
from titanlite.parallel.expert_tensor_parallel import check_etp_degree
from titanlite.parallel.parallelize import reshard_after_forward


@dataclass(frozen=True)
class Layout:
    """A layout the planner weighs: the mesh's degrees, and what else a layout changes that is not a degree."""

    dims: ParallelDims = ParallelDims.of()
    reshard: str = "always"  # under FSDP: 'always' (ZeRO-3) or 'never' (ZeRO-2)
    ac: str = "none"
    offload: bool = False  # training.enable_cpu_offload: FSDP's state in host memory

    @property
    def name(self) -> str:
        return describe(self.dims, self.reshard, self.offload)

    def overrides(self, every: bool = False) -> list[str]:
        """The command-line overrides that select this layout. FSDP's resharding comes only where the layout
        uses FSDP; the FSDP-on-one-rank and offload keys only where set (CPU offload turns FSDP on one rank on
        by itself); all of them with `every`, so that two layouts' lists can be compared key by key."""
        out = [*self.dims.overrides(every)]  # with `every`, the expert degrees' keys in every list, at one place
        if every or self.dims.fsdp_enabled:  # FSDP's resharding means nothing without FSDP
            out += ["--parallelism.fsdp_reshard_after_forward", self.reshard]
        out += ["--activation_checkpoint.mode", self.ac]
        single_rank = self.dims.fsdp_single_rank and not self.offload
        if every or single_rank:
            out += ["--parallelism.fsdp_single_rank", str(single_rank).lower()]
        if every or self.offload:
            out += ["--training.enable_cpu_offload", str(self.offload).lower()]
        return out


def layout_of(cfg, world: int, model: ModelPlan) -> Layout:
    """The layout a config runs on `world` ranks, for its planned model (plan_model)."""
    dims = ParallelDims.from_config(cfg.parallelism, world, cpu_offload=cfg.training.enable_cpu_offload)
    check_ep_degree(dims.ep, model.args, model.family)  # the run's own refusals (plan_run), before any estimate
    check_etp_degree(dims.etp, model.args, model.family)
    reshard = "always" if reshard_after_forward(cfg.parallelism.fsdp_reshard_after_forward, dims.pp > 1) else "never"
    if not dims.fsdp_enabled:
        reshard = "always"  # nothing to reshard: the field keeps its default, so equal layouts compare equal
    offload = cfg.training.enable_cpu_offload and dims.fsdp_enabled
    return Layout(dims, reshard, cfg.activation_checkpoint.mode, offload)


def describe(dims: ParallelDims, reshard: str, offload: bool = False) -> str:
    """The layout's name in the planner's words: "ZeRO-3 8 x TP 2", "HSDP 2x8", "CP 8 (ZeRO-2)"."""
    rep, shard, cp = dims.dp_replicate, dims.dp_shard, dims.cp
    parts = []
    if rep > 1 and shard > 1:
        parts.append(f"HSDP {rep}x{shard}")
    elif rep > 1 and cp == 1:
        parts.append(f"DDP {rep}")
    elif rep > 1:
        parts.append(f"HSDP {rep}x{shard}")  # FSDP over the cp ranks inside each replica
    elif shard > 1 or dims.fsdp_single_rank:  # FSDP on one rank reads as ZeRO over 1 rank
        parts.append(f"{'ZeRO-3' if reshard == 'always' else 'ZeRO-2'} {shard}")
    if cp > 1:  # FSDP shards over the cp ranks too: its ZeRO stage is named beside CP when nothing else shards
        parts.append(
            f"CP {cp}" if shard > 1 or rep > 1 else f"CP {cp} ({'ZeRO-3' if reshard == 'always' else 'ZeRO-2'})"
        )
    if dims.tp > 1:
        parts.append(f"TP {dims.tp}")
    if dims.pp > 1:
        parts.append(f"PP {dims.pp}")
    name = " x ".join(parts) or "single device"
    if dims.ep > 1:  # not a factor of the world size: its ranks are dp_shard x cp's
        name += f", EP {dims.ep}"
    if dims.etp > 1:  # the experts split over the TP ranks
        name += f", ETP {dims.etp}"
    return name + " + CPU offload" if offload else name


def candidate_layouts(ngpu: int, nnodes: int, seq_len: int = 0, n_layers: int = 0) -> list[Layout]:
    """Single device, DDP, ZeRO-2, ZeRO-3, HSDP (replicas across nodes), TP within a node, PP across
    nodes (2, 4, 8 and the node count; 16 and 32 where they divide the node count and `n_layers`), and their
    combinations the world size allows; for sequences of LONG_SEQUENCE tokens or more, also CP within a node
    (beside TP where both fit), with FSDP over the rest."""
    world = ngpu * nnodes
    out = [Layout()] if world == 1 else []
    tps = [t for t in (2, 4, 8) if t <= ngpu and ngpu % t == 0]
    degrees = (2, 4, 8, nnodes, *(p for p in DEEP_PIPELINES if n_layers and n_layers % p == 0))
    pps = sorted({p for p in degrees if p > 1 and nnodes % p == 0}) if nnodes > 1 else [1]
    for pp in [1, *[p for p in pps if p > 1]]:
        for tp in [1, *tps]:
            dp = world // (pp * tp)
            if dp * pp * tp != world or dp < 1:
                continue
            if dp == 1:
                if tp > 1 or pp > 1:
                    out.append(Layout(ParallelDims.of(tp=tp, pp=pp)))
                continue
            for rep, shard, reshard in [(dp, 1, "always"), (1, dp, "never"), (1, dp, "always")]:
                out.append(Layout(ParallelDims.of(dp_replicate=rep, dp_shard=shard, tp=tp, pp=pp), reshard))
            per_node = max(1, ngpu // tp) if pp == 1 else 0
            if nnodes > 1 and pp == 1 and per_node > 1 and dp % per_node == 0 and dp // per_node > 1:
                rep = dp // per_node
                out.append(Layout(ParallelDims.of(dp_replicate=rep, dp_shard=per_node, tp=tp, pp=pp)))
    if seq_len >= LONG_SEQUENCE:
        out += context_parallel_layouts(ngpu, nnodes, seq_len)
    return out


# Sequences from this length on are long enough for the planner to offer context parallelism.
LONG_SEQUENCE = 8192
# Pipeline degrees beyond 8 the planner weighs where they divide the node count and the model's layers.
DEEP_PIPELINES = (16, 32)


def context_parallel_layouts(ngpu: int, nnodes: int, seq_len: int) -> list[Layout]:
    """CP 2, 4, 8 within a node (the degree cutting the sequence into 2 x cp equal chunks), alone or beside
    TP, with ZeRO-2 or ZeRO-3 over the remaining ranks x cp."""
    world, out = ngpu * nnodes, []
    for cp in (c for c in (2, 4, 8) if c <= ngpu and ngpu % c == 0 and seq_len % (2 * c) == 0):
        for tp in (t for t in (1, 2, 4, 8) if cp * t <= ngpu and ngpu % (cp * t) == 0):
            shard = world // (cp * tp)
            for reshard in ("never", "always"):
                out.append(Layout(ParallelDims.of(dp_shard=shard, cp=cp, tp=tp), reshard))
    return out


def offload_layouts(ngpu: int, nnodes: int) -> list[Layout]:
    """The FSDP layouts again with CPU offload; on one GPU, FSDP on a one-rank mesh with offload (ZeRO-Offload:
    an 8B model on one 80 GB GPU). A last resort, for when nothing fits on the devices."""
    if ngpu * nnodes == 1:
        return [Layout(ParallelDims.of(fsdp_single_rank=True), offload=True)]
    return [replace(lay, offload=True) for lay in candidate_layouts(ngpu, nnodes) if lay.dims.dp_shard > 1]


def expert_parallel_layouts(layouts: list[Layout], n_experts: int) -> list[Layout]:
    """For a mixture of experts with `n_experts` routed experts per block: each layout with FSDP again with every
    expert-parallel degree above 1 that a run accepts there (allows_ep). None for a dense model."""
    out = []
    for lay in layouts:
        d = lay.dims
        if lay.offload or d.ep > 1 or d.view_degree("dp_shard_cp") == 1:
            continue
        for ep in range(2, d.view_degree("dp_shard_cp") + 1):
            if allows_ep(d, ep, n_experts):
                out.append(replace(lay, dims=replace(d, ep=ep)))
    return out


def expert_tensor_parallel_layouts(layouts: list[Layout]) -> list[Layout]:
    """For a mixture of experts: each layout with TP again with the experts split over its TP ranks (ETP = TP),
    with or without expert parallelism (not beside both EP and CP: dims.check_etp)."""
    return [
        replace(lay, dims=replace(lay.dims, etp=lay.dims.tp))
        for lay in layouts
        if lay.dims.tp > 1 and lay.dims.etp == 1 and not lay.offload and (lay.dims.ep == 1 or lay.dims.cp == 1)
    ]


def allows_ep(dims: ParallelDims, ep: int, n_experts: int) -> bool:
    """Whether a run accepts expert-parallel degree `ep` on these dims for `n_experts` experts per block: the run's
    own checks answer (dims.check_ep, expert_parallel.check_experts_split), so the rule is stated once."""
    try:
        check_ep(ep, dims.dp_shard, dims.cp)
        check_experts_split(ep, n_experts, "")
    except ConfigError:
        return False
    return True
