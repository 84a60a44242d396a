"""Full activation checkpointing lowers the activation memory of the debug model at a longer sequence,
measured on real tensors with PyTorch's MemTracker."""

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from titanlite.components.loss import cross_entropy
from titanlite.config import ActivationCheckpoint
from titanlite.models.build import build_model
from titanlite.models.common.init import init_weights
from titanlite.parallel.activation_checkpoint import apply_ac


def peak_activation_bytes(mode: str, seq_len: int = 512) -> int:
    model = build_model("gpt2", "debug", 256, seq_len)
    init_weights(model, 0)
    apply_ac(model, ActivationCheckpoint(mode=mode))
    tokens = torch.randint(0, 256, (8, seq_len + 1))
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Activation"]


def test_full_ac_lowers_peak_activation_memory():
    none, full = peak_activation_bytes("none"), peak_activation_bytes("full")
    print(
        f"peak activation memory, gpt2 debug, batch 8 x 512: none {none / 2**20:.1f} MiB, full AC {full / 2**20:.1f} "
        "MiB"
    )
    assert full < 0.6 * none
