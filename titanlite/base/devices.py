"""Which device a process computes on: one switch, TITANLITE_DEVICE, read by every command and worker.

  unset or 'auto'  CUDA (NCCL between ranks) when torch sees a GPU, else the CPU (gloo)
  'cpu'            the CPU and gloo, whatever GPUs are visible: the test suite sets it, and a user can
                   debug any layout with it on a GPU box (`TITANLITE_DEVICE=cpu NGPU=4 ./run_train.sh`)
  'cuda'           CUDA, and a one-line error where torch sees no GPU

Local rank k computes on cuda:k, so a node runs at most as many CUDA ranks as it has visible GPUs
(`check_local_ranks`, called before torchrun starts any worker).
"""

from __future__ import annotations

import os

import torch

from titanlite.base.errors import ConfigError

ENV = "TITANLITE_DEVICE"
CHOICES = ("auto", "cpu", "cuda")


def device_type() -> str:
    """'cuda' or 'cpu', as TITANLITE_DEVICE and the visible GPUs decide."""
    value = os.environ.get(ENV, "").strip().lower() or "auto"
    if value not in CHOICES:
        raise ConfigError(
            f"{ENV}='{value}' is not a device; use cpu, cuda, or leave it unset (CUDA where a GPU is visible)"
        )
    if value == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if value == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"{ENV}=cuda but torch sees no CUDA GPU here (torch {torch.__version__}, "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); unset it to run on the CPU"
        )
    return value


def uses_cuda() -> bool:
    return device_type() == "cuda"


def local_device(local_rank: int) -> torch.device:
    """This process's device: cuda:LOCAL_RANK (made current) or the CPU."""
    if device_type() == "cpu":
        return torch.device("cpu")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def check_local_ranks(nproc_per_node: int) -> None:
    """Refuse more CUDA ranks on this node than it has visible GPUs (each rank needs a GPU of its own:
    NCCL refuses two ranks on one device, and ranks past the last GPU fail at cuda:LOCAL_RANK)."""
    if device_type() != "cuda":
        return
    visible = torch.cuda.device_count()
    if nproc_per_node > visible:
        raise ConfigError(
            f"NGPU={nproc_per_node} processes per node, but this machine has {visible} visible CUDA GPU(s); "
            f"set NGPU <= {visible}, or {ENV}=cpu to run {nproc_per_node} gloo processes on the CPU"
        )
