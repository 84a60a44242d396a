"""The layouts the planner weighs: a config's own, and every candidate a machine allows (single device, DDP,
ZeRO-2/3, HSDP across nodes, TP within a node, PP across nodes, CP for long sequences, CPU offload as a last
resort), each with the command-line overrides that select it."""

from __future__ import annotations

from dataclasses import dataclass, replace

from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.parallelize import reshard_after_forward


@dataclass(frozen=True)
class Layout:
    name: str
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    reshard: str = "always"  # under FSDP: 'always' (ZeRO-3) or 'never' (ZeRO-2)
    ac: str = "none"
    fsdp_single_rank: bool = False  # FSDP on a one-rank mesh (world 1): FSDP with dp_shard 1
    offload: bool = False  # training.enable_cpu_offload: FSDP's state in host memory
    cp: int = 1  # context parallel: ranks that split each sequence (FSDP shards over dp_shard x cp)

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims.of(
            self.fsdp_single_rank,
            dp_replicate=self.dp_replicate,
            dp_shard=self.dp_shard,
            cp=self.cp,
            tp=self.tp,
            pp=self.pp,
        )

    @property
    def ranks(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    def overrides(self, every: bool = False) -> list[str]:
        """The command-line overrides that select this layout. The FSDP-on-one-rank and offload keys come
        only where set (CPU offload turns FSDP on one rank on by itself), or always with `every`, so that
        two layouts' lists can be compared key by key."""
        out = [
            "--parallelism.data_parallel_replicate_degree",
            str(self.dp_replicate),
            "--parallelism.data_parallel_shard_degree",
            str(self.dp_shard),
            "--parallelism.context_parallel_degree",
            str(self.cp),
            "--parallelism.tensor_parallel_degree",
            str(self.tp),
            "--parallelism.pipeline_parallel_degree",
            str(self.pp),
            "--parallelism.fsdp_reshard_after_forward",
            self.reshard,
            "--activation_checkpoint.mode",
            self.ac,
        ]
        single_rank = self.fsdp_single_rank and not self.offload
        if every or single_rank:
            out += ["--parallelism.fsdp_single_rank", str(single_rank).lower()]
        if every or self.offload:
            out += ["--training.enable_cpu_offload", str(self.offload).lower()]
        return out


def layout_of(cfg, world: int) -> Layout:
    """The layout a config runs on `world` ranks."""
    dims = ParallelDims.from_config(cfg.parallelism, world, cpu_offload=cfg.training.enable_cpu_offload)
    reshard = "always" if reshard_after_forward(cfg.parallelism.fsdp_reshard_after_forward, dims.pp > 1) else "never"
    offload = cfg.training.enable_cpu_offload and dims.fsdp_enabled
    name = describe(
        dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp, reshard, dims.fsdp_single_rank, offload, dims.cp
    )
    return Layout(
        name,
        dims.dp_replicate,
        dims.dp_shard,
        dims.tp,
        dims.pp,
        reshard,
        cfg.activation_checkpoint.mode,
        dims.fsdp_single_rank,
        offload,
        dims.cp,
    )


def describe(
    rep: int,
    shard: int,
    tp: int,
    pp: int,
    reshard: str,
    single_rank: bool = False,
    offload: bool = False,
    cp: int = 1,
) -> str:
    parts = []
    if rep > 1 and shard > 1:
        parts.append(f"HSDP {rep}x{shard}")
    elif rep > 1 and cp == 1:
        parts.append(f"DDP {rep}")
    elif rep > 1:
        parts.append(f"HSDP {rep}x{shard}")  # FSDP over the cp ranks inside each replica
    elif shard > 1 or single_rank:  # FSDP on one rank reads as ZeRO over 1 rank
        parts.append(f"{'ZeRO-3' if reshard == 'always' else 'ZeRO-2'} {shard}")
    if cp > 1:  # FSDP shards over the cp ranks too: its ZeRO stage is named beside CP when nothing else shards
        parts.append(
            f"CP {cp}" if shard > 1 or rep > 1 else f"CP {cp} ({'ZeRO-3' if reshard == 'always' else 'ZeRO-2'})"
        )
    if tp > 1:
        parts.append(f"TP {tp}")
    if pp > 1:
        parts.append(f"PP {pp}")
    name = " x ".join(parts) or "single device"
    return name + " + CPU offload" if offload else name


def candidate_layouts(ngpu: int, nnodes: int, seq_len: int = 0) -> list[Layout]:
    """Single device, DDP, ZeRO-2, ZeRO-3, HSDP (replicas across nodes), TP within a node, PP across
    nodes, and their combinations the world size allows; for sequences of LONG_SEQUENCE tokens or more,
    also CP within a node (beside TP where both fit), with FSDP over the rest."""
    world = ngpu * nnodes
    out = [Layout("single device")] if world == 1 else []
    tps = [t for t in (2, 4, 8) if t <= ngpu and ngpu % t == 0]
    pps = sorted({p for p in (2, 4, 8, nnodes) if p > 1 and nnodes % p == 0}) if nnodes > 1 else [1]
    for pp in [1, *[p for p in pps if p > 1]]:
        for tp in [1, *tps]:
            dp = world // (pp * tp)
            if dp * pp * tp != world or dp < 1:
                continue
            if dp == 1:
                if tp > 1 or pp > 1:
                    out.append(Layout(describe(1, 1, tp, pp, "always"), tp=tp, pp=pp))
                continue
            for rep, shard, reshard in [(dp, 1, "always"), (1, dp, "never"), (1, dp, "always")]:
                out.append(Layout(describe(rep, shard, tp, pp, reshard), rep, shard, tp, pp, reshard))
            per_node = max(1, ngpu // tp) if pp == 1 else 0
            if nnodes > 1 and pp == 1 and per_node > 1 and dp % per_node == 0 and dp // per_node > 1:
                rep = dp // per_node
                out.append(Layout(describe(rep, per_node, tp, pp, "always"), rep, per_node, tp, pp, "always"))
    if seq_len >= LONG_SEQUENCE:
        out += context_parallel_layouts(ngpu, nnodes, seq_len)
    return out


# Sequences from this length on are long enough for the planner to offer context parallelism.
LONG_SEQUENCE = 8192


def context_parallel_layouts(ngpu: int, nnodes: int, seq_len: int) -> list[Layout]:
    """CP 2, 4, 8 within a node (the degree cutting the sequence into 2 x cp equal chunks), alone or beside
    TP, with ZeRO-2 or ZeRO-3 over the remaining ranks x cp."""
    world, out = ngpu * nnodes, []
    for cp in (c for c in (2, 4, 8) if c <= ngpu and ngpu % c == 0 and seq_len % (2 * c) == 0):
        for tp in (t for t in (1, 2, 4, 8) if cp * t <= ngpu and ngpu % (cp * t) == 0):
            shard = world // (cp * tp)
            for reshard in ("never", "always"):
                name = describe(1, shard, tp, 1, reshard, cp=cp)
                out.append(Layout(name, 1, shard, tp, 1, reshard, cp=cp))
    return out


def offload_layouts(ngpu: int, nnodes: int) -> list[Layout]:
    """The FSDP layouts again with CPU offload; on one GPU, FSDP on a one-rank mesh with offload (ZeRO-Offload:
    an 8B model on one 80 GB GPU). A last resort, for when nothing fits on the devices."""
    if ngpu * nnodes == 1:
        return [Layout(describe(1, 1, 1, 1, "always", True, True), fsdp_single_rank=True, offload=True)]
    return [
        replace(
            lay, name=describe(lay.dp_replicate, lay.dp_shard, lay.tp, lay.pp, lay.reshard, offload=True), offload=True
        )
        for lay in candidate_layouts(ngpu, nnodes)
        if lay.dp_shard > 1
    ]
