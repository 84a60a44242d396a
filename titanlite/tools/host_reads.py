"""Counting the places where the host reads a tensor's value (and so, on CUDA, waits for the device).

`count_host_reads(where)` watches, through a TorchFunctionMode (torch's own hook for every call of a torch function
or Tensor method; nothing of torch is replaced), the Tensor methods that hand a value to Python (`item`, `tolist`,
`float()`, `int()`, `bool()`, `.cpu()`, `.numpy()`) and records each call made directly from a file
that `where(filename)` accepts. Calls inside torch itself are not counted: the point is what our own
code asks for. On CUDA, `torch.cuda.set_sync_debug_mode` sees every synchronisation, torch's included:
`count_cuda_syncs` counts those.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

READS = frozenset(("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy"))


@dataclass
class HostReads:
    calls: list[tuple[str, str, int]] = field(default_factory=list)  # (method, file, line)

    def __len__(self) -> int:
        return len(self.calls)


class _HostReadMode(TorchFunctionMode):
    def __init__(self, where, reads: HostReads):
        super().__init__()
        self.where, self.reads = where, reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS:
            caller = sys._getframe(1)  # the Python frame that called the method (the method itself is C)
            if self.where(caller.f_code.co_filename):
                self.reads.calls.append((name, caller.f_code.co_filename, caller.f_lineno))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_host_reads(where):
    reads = HostReads()
    with _HostReadMode(where, reads):
        yield reads


def outside_torch(filename: str) -> bool:
    return "/torch/" not in filename


@contextlib.contextmanager
def count_cuda_syncs(device: torch.device):
    """The number of host-device synchronisations CUDA reports while the block runs (0 off CUDA)."""
    counter = [0]
    if device.type != "cuda":
        yield counter
        return
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counter
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    counter[0] = sum("synchroniz" in str(w.message) for w in caught)
