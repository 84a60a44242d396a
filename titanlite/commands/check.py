"""`titanlite check`: everything that can be refused before torchrun starts any worker (run_train.sh runs it
first): the config and layout (plan_run), the data (its prepared store is built here, once), and the
memory preflight, which refuses a layout that cannot fit.

The memory figure is `titanlite plan`'s estimate (titanlite/builder/estimate.py) of the config's own layout,
for the device this machine computes on (titanlite.base.devices.device_type()), so plan and check agree. It
counts tensors only; what a process needs besides them is added from the named constants below, and
every printed figure is called an estimate. Each rank's need is compared with its share of a pool:

  cuda  the memory of its own GPU (local rank k computes on cuda:k; GPU 0 stands for all of them)
  cpu   the node's available RAM, shared by the node's ranks: a CPU run's tensors, and under
        training.enable_cpu_offload the FSDP state that CUDA ranks keep in host memory

  need > share         ConfigError, one line: the figures, the planner's recommended layout for this
                       machine (or what to change when none fits), and how to skip the check
  need > 90 % share    one warning line, then on
  otherwise            one line with the figures
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from titanlite.base import devices, logs
from titanlite.base.command_line import take_options
from titanlite.base.errors import ConfigError
from titanlite.builder.data import build_data, build_validation_data, describe_validation
from titanlite.builder.estimate import Machine, batch_overrides, estimate, layout_rows, recommend, setting_for
from titanlite.builder.layouts import layout_of
from titanlite.builder.model_facts import cached_model_facts
from titanlite.builder.plan import ModelPlan, plan_run
from titanlite.builder.run import run_facts
from titanlite.components import run_lock
from titanlite.components.checkpoint import check_resume, initial_weights_path
from titanlite.components.hf_weights import check_hf_values, is_hf_folder
from titanlite.config import parse_config, refuse_repeated_keys
from titanlite.engine.downstream import check_tasks
from titanlite.engine.validator import set_sizes

GIB = 2**30
# GPU memory a CUDA rank uses besides its tensors: the CUDA context (about 0.5 GiB on Hopper with lazy
# module loading), cuBLAS workspaces and NCCL's communicator buffers. They are not tensors, so neither the
# planner nor PyTorch's memory trackers see them.
CUDA_RUNTIME_BYTES = 1 * GIB
# Host memory a training process uses besides its tensors: the interpreter, torch's libraries, gloo and the
# data pipeline. A CPU rank of the debug model (seq 32, ZeRO-3 over 2 ranks) peaks at about 0.6 GiB of
# private memory (/proc/PID/smaps_rollup), of which its tensors are at most 0.2 GiB. Shared library pages
# and torchrun's agent (about 0.15 GiB per node) are left out.
PROCESS_RUNTIME_BYTES = GIB // 2
# Above this share of its memory a rank is warned: the caching allocator's fragmentation and the estimate's
# own error need the rest. `titanlite plan --headroom 0.1` keeps the same share free.
WARN_SHARE = 0.9
SKIP = "skip this check with --training.memory_preflight false"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Capacity:
    """A pool of memory and the processes of this node that draw on it."""

    bytes: float  # one GPU's memory, or the node's available RAM
    what: str  # "NVIDIA H100 80GB HBM3", "available RAM"
    shared_by: int = 1

    @property
    def per_rank(self) -> float:
        return self.bytes / self.shared_by

    def describe(self) -> str:
        shared = f" shared by {self.shared_by} processes" if self.shared_by > 1 else ""
        return f"{self.bytes / GIB:.1f} GiB of {self.what}{shared}"


def memory_capacity(pool: str, local_ranks: int) -> Capacity | None:
    """The memory behind `pool`: 'cuda', GPU 0 (one GPU per rank, the node's GPUs taken to be alike);
    'cpu', the node's available RAM shared by its `local_ranks` processes. None where it cannot be told.
    The one place that asks the machine, so tests can pretend to be another."""
    if pool == "cuda":
        props = torch.cuda.get_device_properties(0)
        return Capacity(props.total_memory, props.name)
    ram = available_ram()
    return None if ram is None else Capacity(ram[0], ram[1], local_ranks)


def available_ram() -> tuple[int, str] | None:
    """MemAvailable from /proc/meminfo on Linux (free memory plus the page cache and slabs the kernel can
    reclaim, which is what a new process can take); elsewhere the free, else the physical, pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "available RAM"
    except OSError:
        pass
    for name, what in (("SC_AVPHYS_PAGES", "free RAM"), ("SC_PHYS_PAGES", "physical RAM")):
        try:
            return os.sysconf(name) * os.sysconf("SC_PAGE_SIZE"), what
        except (AttributeError, ValueError, OSError):
            continue
    return None


def config_estimate(cfg, world_size: int, device: str, model: ModelPlan):
    """The planner's facts, the config's own layout and its estimate (the rank with the largest peak)
    on `device` for the planned model: the row `titanlite plan --ngpu N --device DEVICE` marks '(config)'."""
    facts = cached_model_facts(cfg, model)
    own = layout_of(cfg, world_size, model)
    return facts, own, estimate(facts, own, setting_for(cfg, own, world_size, device))


def rank_needs(est: dict, device: str) -> dict[str, tuple[float, float, str]]:
    """Per pool: (bytes one rank needs, of which tensors, what the rest is). A CUDA rank needs its GPU,
    and the node's RAM only for offloaded state; a CPU rank needs the RAM."""
    if device == "cuda":
        needs = {"cuda": (est["peak"] + CUDA_RUNTIME_BYTES, est["peak"], "CUDA runtime")}
        if est["host"]:
            needs["cpu"] = (est["host"] + PROCESS_RUNTIME_BYTES, est["host"], "process runtime")
        return needs
    return {"cpu": (est["peak"] + PROCESS_RUNTIME_BYTES, est["peak"], "process runtime")}


def gib(n: float, pool: str, device: str) -> str:
    """'12.3 GiB', or '12.3 GiB of host memory' for the RAM that a CUDA rank's offloaded state takes."""
    return f"{n / GIB:.1f} GiB" + (" of host memory" if pool == "cpu" and device == "cuda" else "")


def describe_need(need: tuple[float, float, str], pool: str, device: str) -> str:
    total, tensors, rest = need
    return (
        f"about {gib(total, pool, device)} per rank (estimate: {tensors / GIB:.1f} GiB of tensors + "
        f"{(total - tensors) / GIB:.1f} GiB {rest})"
    )


def memory_preflight(cfg, world_size: int, local_ranks: int, model: ModelPlan) -> None:
    """Compare the planner's estimate of each rank's peak with its memory: raise ConfigError when it does
    not fit, warn when it is within 10 % of it, else say the figures. Off with training.memory_preflight."""
    if not cfg.training.memory_preflight:
        return
    device = devices.device_type()
    facts, own, est = config_estimate(cfg, world_size, device, model)
    capacities: dict[str, Capacity | None] = {}

    def capacity(pool: str) -> Capacity | None:
        if pool not in capacities:
            capacities[pool] = memory_capacity(pool, local_ranks)
        return capacities[pool]

    needs = rank_needs(est, device)
    parts, over, near = [], [], []
    for pool, need in needs.items():
        cap = capacity(pool)
        if cap is None:
            parts.append(f"{describe_need(need, pool, device)}; this machine's free memory is unknown, not checked")
            continue
        parts.append(f"{describe_need(need, pool, device)} of {cap.describe()}")
        if need[0] > cap.per_rank:
            over.append(f"{describe_need(need, pool, device)}, more than {cap.describe()}")
        elif need[0] > WARN_SHARE * cap.per_rank:
            near.append(f"{describe_need(need, pool, device)} is {need[0] / cap.per_rank:.0%} of {cap.describe()}")
    if over:
        advice = alternative(cfg, facts, own, world_size, local_ranks, device, capacity)
        raise ConfigError(
            f"memory: {cfg.model.name} {cfg.model.flavor} on {own.name} needs "
            + "; and ".join(over)
            + f"; {advice}; or {SKIP}"
        )
    if near:
        logger.warning(
            f"titanlite: warning: memory: {cfg.model.name} {cfg.model.flavor} on {own.name}: "
            + "; and ".join(near)
            + "; the allocator's fragmentation may not fit in the rest (activation_checkpoint.mode full or a lower "
            "training.local_batch_size leaves more room)"
        )
        return
    logger.info("titanlite: memory: " + "; ".join(parts))


def alternative(cfg, facts, own, world_size: int, local_ranks: int, device: str, capacity) -> str:
    """What the planner recommends on this machine (its local_ranks processes on each of world_size /
    local_ranks nodes), as the overrides that differ from the config; or, when no layout fits, what to change."""
    nnodes = max(1, world_size // local_ranks)

    def fits(est: dict) -> bool:  # with the headroom a run needs: the warning's share, as plan's --headroom
        for pool, need in rank_needs(est, device).items():
            cap = capacity(pool)
            if cap is not None and need[0] > WARN_SHARE * cap.per_rank:
                return False
        return True

    rows = layout_rows(cfg, facts, own, Machine(local_ranks, nnodes, device), fits)
    pick, _ = recommend(rows)
    per_node = (
        f"{local_ranks} GPU" + "s" * (local_ranks > 1)
        if device == "cuda"
        else f"{local_ranks} process" + "es" * (local_ranks > 1)
    )
    machine = per_node + (f" x {nnodes} nodes" if nnodes > 1 else "")
    if pick is None:
        tried = "activation checkpointing or CPU offload" if device == "cuda" else "activation checkpointing"
        return (
            f"no layout of {machine} fits, even with {tried}: use more nodes, a smaller model.flavor, "
            "a shorter training.seq_len or a lower training.local_batch_size"
        )
    lay = pick["layout"]
    figures = " and ".join(gib(need[0], pool, device) for pool, need in rank_needs(pick["est"], device).items())
    return (
        f"for {machine} the planner recommends {lay.name}, AC {lay.ac} (about {figures} per rank, estimated): "
        + " ".join(changed_overrides(own, lay) + batch_overrides(cfg, pick))
    )


def changed_overrides(own, lay) -> list[str]:
    """`--section.key value` pairs of layout `lay` whose value differs from the config's own layout (FSDP's
    resharding only where `lay` has FSDP: elsewhere it changes nothing)."""
    mine, theirs = own.overrides(every=True), lay.overrides(every=True)
    pairs = zip(theirs[::2], theirs[1::2], mine[1::2])
    return [
        f"{key} {value}"
        for key, value, current in pairs
        if value != current and (key != "--parallelism.fsdp_reshard_after_forward" or lay.dims.fsdp_enabled)
    ]


def check(argv: list[str]) -> int:
    """`titanlite check --world-size N [--nproc-per-node K]`: validate the config for N processes (K per
    node, N / K nodes; K defaults to N, one node), prepare its data and check its memory."""
    at_least = {"world-size": 1.0, "nproc-per-node": 1.0}
    opts, rest = take_options(argv, {"world-size": 1, "nproc-per-node": 0}, "check", at_least=at_least)
    refuse_repeated_keys(rest)  # the launcher's --check comes here without titanlite's command line
    world_size = opts["world-size"]
    local_ranks = opts["nproc-per-node"] or world_size
    if local_ranks > world_size:
        raise ConfigError(
            f"check --nproc-per-node {local_ranks} is more than --world-size {world_size}: the world size is every "
            "node's processes together; give --world-size N x nodes, or fewer processes per node"
        )
    if world_size % local_ranks:
        raise ConfigError(
            f"check --nproc-per-node {local_ranks} does not divide --world-size {world_size}: each node runs the "
            "same number of processes (world size = processes per node x nodes)"
        )
    cfg = parse_config(rest)
    if world_size == local_ranks:  # one node: a second launch on a busy run folder stops here, at once
        run_lock.check_free(Path(cfg.job.dump_folder) / cfg.job.name)
    devices.check_local_ranks(local_ranks)
    plan = plan_run(cfg, world_size)
    if is_hf_folder(initial := initial_weights_path(cfg)):  # its headers were plan_run's; its values, once, here
        check_hf_values(initial)
    tokenizer = plan.model.tokenizer
    corpus = build_data(cfg, tokenizer, verify="sample")
    for line in corpus.describe(plan.global_batch_size * cfg.training.steps):
        logger.info(f"titanlite: data: {line}")
    memory_preflight(cfg, world_size, local_ranks, plan.model)
    with logs.restyled(lambda line: f"titanlite: {line.strip()}"):  # a run's '  checkpoint: ...', in the check's voice
        check_resume(cfg, run_facts(plan.model, corpus))
    if cfg.validation.enable:
        windows = build_validation_data(cfg, tokenizer, corpus, verify="sample")
        logger.info(
            f"titanlite: {describe_validation(cfg, corpus, len(windows), plan.dims.dp, sets=set_sizes(windows))}"
        )
    if cfg.downstream.tasks:
        kinds = check_tasks(cfg.downstream, tokenizer)
        named = ", ".join(f"{name} ({kind})" for name, kind in kinds.items())
        logger.info(f"titanlite: downstream: {named}, scored every {cfg.downstream.interval} steps and at the last")
    logger.info(
        f"titanlite: config ok for {world_size} process(es): {plan.dims.describe()}, "
        f"global batch {plan.global_batch_size}, accumulation {plan.grad_accum_steps}"
    )
    return 0
