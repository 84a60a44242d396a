"""A worker process's runtime: its device and process group, determinism, and the CPU allocator."""

from __future__ import annotations

import ctypes
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from titanlite.base.devices import local_device
from titanlite.builder.plan import Plan
from titanlite.components.checkpoint import needs_process_group
from titanlite.config import JobConfig


def start_rank(cfg: JobConfig, plan: Plan, world_size: int) -> torch.device:
    """After this process's plan (plan_run: every check first), its seeds, device and process group, in that
    order."""
    set_determinism(cfg)
    one_rank_group = plan.dims.fsdp_single_rank or needs_process_group(cfg)
    device = init_distributed(world_size, cfg.comm.init_timeout_seconds, one_rank_mesh=one_rank_group)
    if device.type == "cpu":
        keep_freed_memory_on_cpu()
    return device


def init_distributed(world_size: int, init_timeout_seconds: float, one_rank_mesh: bool = False) -> torch.device:
    """This rank's device (titanlite.base.devices) and, for several ranks, the process group: NCCL on CUDA,
    gloo on the CPU. One rank gets an in-memory group too when its mesh has a one-rank dimension
    (FSDP on a single device) or DCP's process-based saver needs one (async_with_pinned_mem)."""
    device = local_device(int(os.environ.get("LOCAL_RANK", 0)))
    backend = "nccl" if device.type == "cuda" else "gloo"
    device_id = device if device.type == "cuda" else None
    timeout = timedelta(seconds=init_timeout_seconds)
    if world_size > 1:
        dist.init_process_group(backend, timeout=timeout, device_id=device_id)
    elif one_rank_mesh and not dist.is_initialized():
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, device_id=device_id
        )
    return device


def set_determinism(cfg: JobConfig) -> None:
    torch.manual_seed(cfg.training.seed)
    deterministic = cfg.training.deterministic
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    # TF32 for float32 matmuls is free speed on Ampere and later, but changes results: off when deterministic.
    torch.backends.cuda.matmul.allow_tf32 = not deterministic
    torch.backends.cudnn.allow_tf32 = not deterministic


def keep_freed_memory_on_cpu() -> bool:
    """On the CPU, tell glibc's malloc to keep freed memory for reuse instead of returning it to the OS.

    By default every allocation above 32 MiB (the logits, the vocabulary-sized gradients) is a fresh
    mmap that the kernel must fault in and zero page by page, on every step: on the debug model that was
    half of each step's wall time and most of its noise. Without mmap and trimming, freed blocks are
    reused: a step of the debug model takes 201 ms rather than 311, and the bare loop 195 rather than 532
    (BENCHMARKS.md), at the cost of a resident size that stays at its peak. Set TITANLITE_CPU_MALLOC=default to
    keep glibc's behaviour. No-op off glibc."""
    if os.environ.get("TITANLITE_CPU_MALLOC", "") == "default" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_max = -1, -4
        return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))
    except (OSError, AttributeError):  # not glibc (e.g. musl)
        return False
