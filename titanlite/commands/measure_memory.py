"""`titanlite plan --measure`'s worker side: train a few steps under a tensor-level memory tracker and write
this rank's peak (TITANLITE_MEASURE_MEMORY names the folder; titanlite/commands/train.py calls it)."""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import torch
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorBytes:
    """Bytes of tensor storage alive on one device, and their peak: every tensor an operator creates is
    counted until its storage is freed. Unlike MemTracker, it needs no module hooks, so it also follows
    pipeline schedules (which run stage modules several times per step and call autograd.grad); it
    does not see inside DTensor operations, so it is used for pipeline stages only."""

    def __init__(self, device: torch.device):
        self.device, self.current, self.peak = device, 0, 0
        self.live: dict[int, weakref.ref] = {}  # storage -> a reference whose callback forgets it

    def add(self, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor) or t.device != self.device or t.is_meta:
            return
        storage = t.untyped_storage()
        key = id(storage)  # torch keeps one Python object per storage while it lives; the weakref below ends with it
        if key in self.live:
            return
        size = storage.nbytes()
        self.live[key] = weakref.ref(storage, lambda _: self.remove(key, size))
        self.current += size
        self.peak = max(self.peak, self.current)

    def remove(self, key: int, size: int) -> None:
        if self.live.pop(key, None) is not None:
            self.current -= size

    def mode(self):
        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    tracker.add(t.to_local() if hasattr(t, "to_local") else t)
                return out

        return Mode()


def measure_peak(trainer, fsdp: bool, device: torch.device, out: Path, total_steps: int) -> None:
    """Train to `total_steps` under a tensor-level memory tracker and write this rank's peak: PyTorch's
    MemTracker (FSDPMemTracker under FSDP), which also sees the tensors inside DTensor operations; under
    pipeline parallelism, whose schedules its module hooks cannot follow, LiveTensorBytes."""
    out.parent.mkdir(parents=True, exist_ok=True)
    optimizers = trainer.optimizer.optimizers
    if trainer.pipeline is not None:
        tracker = LiveTensorBytes(device)
        existing = [p for part in trainer.model_parts for p in part.parameters()]
        existing += [b for part in trainer.model_parts for b in part.buffers()]
        existing += [t for opt in optimizers for state in opt.state.values() for t in state.values()]
        for t in existing:
            tracker.add(t.to_local() if isinstance(t, DTensor) else t)
        with tracker.mode():
            trainer.train(total_steps)
        out.write_text(json.dumps({"Total": tracker.peak, "tracker": "LiveTensorBytes"}))

        return
    mem: MemTracker
    if fsdp and len(trainer.model_parts) == 1:
        mem = FSDPMemTracker(trainer.model_parts[0], optimizers[0])
        mem.track_external(*optimizers[1:])  # Muon's beside AdamW: its momenta counted as optimizer state too
    else:
        mem = MemTracker()
        mem.track_external(*trainer.model_parts, *optimizers)
    figures: dict = {}
    with mem:
        while trainer.step < total_steps:  # its module statistics cover one iteration at a time
            trainer.train(trainer.step + 1)
            peak = mem.get_tracker_snapshot("peak")
            step_figures = next(iter(peak.values())) if peak else {}
            if step_figures.get("Total", 0) >= figures.get("Total", 0):
                figures = step_figures
            mem.reset_mod_stats()
    out.write_text(json.dumps({getattr(k, "value", str(k)): v for k, v in figures.items()} | {"tracker": "MemTracker"}))
