"""torch.profiler traces and CUDA memory snapshots of chosen training steps.

Every `profile_freq` steps the profiler records the last `profile_active_steps` of them (after one
untraced warm-up step, which keeps the profiler's own start-up out of the window) and writes one Chrome
trace per rank: <run folder>/<save_traces_folder>/iteration_<step>/rank<r>_trace.json, where <step> is
the last step recorded. `titanlite analyze` reads these folders. With enable_memory_snapshot on CUDA,
the allocator's history is recorded from the first step and a snapshot is written beside each trace
(rank<r>_memory_snapshot.pickle), to be opened at https://pytorch.org/memory_viz.
"""

from __future__ import annotations

import logging
import pickle
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from titanlite.base.errors import ConfigError
from titanlite.config import Profiling

MEMORY_HISTORY_ENTRIES = 100_000

logger = logging.getLogger(__name__)


def check_profiling(cfg: Profiling) -> None:
    if not cfg.enable_profiling:
        return
    if cfg.profile_active_steps < 1:
        raise ConfigError(f"profiling.profile_active_steps={cfg.profile_active_steps} must be at least 1")
    if cfg.profile_freq <= cfg.profile_active_steps:
        raise ConfigError(
            f"profiling.profile_freq={cfg.profile_freq} must exceed profiling.profile_active_steps="
            f"{cfg.profile_active_steps} (each window needs a warm-up step before it)"
        )


class Profiler:
    """Context manager around the training loop; call step() after every training step."""

    def __init__(self, cfg: Profiling, run_dir: Path, rank: int, device: torch.device, current_step: Callable[[], int]):
        self.folder = run_dir / cfg.save_traces_folder
        self.rank, self.device, self.current_step = rank, device, current_step
        self.snapshots = cfg.enable_memory_snapshot and device.type == "cuda"
        if cfg.enable_memory_snapshot and not self.snapshots:
            logger.warning("  profiling: memory snapshots need CUDA; this run records traces only")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        warmup = 1
        # torch warns that each window's events are cleared after it is written, which is the intent.
        warnings.filterwarnings("ignore", message="Profiler clears events at the end of each cycle")
        self.profiler = profile(
            activities=activities,
            schedule=schedule(
                wait=cfg.profile_freq - cfg.profile_active_steps - warmup,
                warmup=warmup,
                active=cfg.profile_active_steps,
            ),
            on_trace_ready=self.write,
        )

    def __enter__(self) -> Profiler:
        if self.snapshots:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        self.profiler.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.profiler.__exit__(*exc)
        if self.snapshots:
            torch.cuda.memory._record_memory_history(enabled=None)

    def step(self) -> None:
        self.profiler.step()

    def write(self, prof) -> None:
        window = self.folder / f"iteration_{self.current_step()}"
        window.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(window / f"rank{self.rank}_trace.json"))
        if self.snapshots:
            with open(window / f"rank{self.rank}_memory_snapshot.pickle", "wb") as f:
                pickle.dump(torch.cuda.memory._snapshot(), f)
        logger.info(f"  profiling: wrote {window}")
