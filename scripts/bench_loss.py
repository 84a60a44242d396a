"""The output projection and cross-entropy alone, forward and backward, on one GPU: titanlite's two losses
against a fused linear + cross-entropy kernel (Liger's, where `liger_kernel` imports), at GPT-2 shapes.

    python3 scripts/bench_loss.py [--output loss.json]

Each variant takes hidden states [tokens, dim] and the [vocab, dim] weight in bfloat16 (as autocast hands
them to the loss), returns the mean loss and fills both gradients. Timed with CUDA events after 3 warm-up
calls, the median of 20; peak memory is the allocator's peak above what the inputs hold. Variants:
  plain compiled   logits and F.cross_entropy in float32, torch.compile'd (the default with compile on)
  plain eager      the same, not compiled
  chunked          titanlite's ChunkedCrossEntropy, 4096 tokens a chunk, its softmax compiled
  liger fused      LigerFusedLinearCrossEntropyLoss (chunks its matmuls and softmax in Triton)
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from titanlite.components.loss import ChunkedCrossEntropy

SHAPES = {  # name: (tokens, dim, vocab)
    "124M b16": (16 * 1024, 768, 50304),
    "124M b64": (64 * 1024, 768, 50304),
    "774M b8": (8 * 1024, 1280, 50304),
    "774M b16": (16 * 1024, 1280, 50304),
}


def plain(hidden, weight, labels):
    return F.cross_entropy((hidden @ weight.t()).float(), labels)


def variants() -> dict:
    found = {"plain compiled": torch.compile(plain), "plain eager": plain}

    class Head(torch.nn.Module):
        def __init__(self, weight):
            super().__init__()
            self.weight = weight

    def chunked(hidden, weight, labels):
        return ChunkedCrossEntropy(Head(weight), 4096, compiled=True)(hidden[None], labels[None])

    found["chunked"] = chunked
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        fused = LigerFusedLinearCrossEntropyLoss()
        found["liger fused"] = lambda hidden, weight, labels: fused(weight, hidden, labels)
    except ImportError as e:
        print(f"liger fused: not measured ({e})")
    return found


def measure(fn, hidden, weight, labels) -> tuple[float, float, torch.Tensor]:
    def call():
        hidden.grad = weight.grad = None
        loss = fn(hidden, weight, labels)
        loss.backward()
        return loss

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return statistics.median(times), peak, loss.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default="")
    a = parser.parse_args()
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; forward + backward, bf16 inputs")
    print("| shape | variant | ms | GiB above inputs | loss - plain eager's |")
    print("|---|---|---:|---:|---:|")
    for shape, (tokens, dim, vocab) in SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        hidden = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        weight = (0.02 * torch.randn(vocab, dim, device="cuda", generator=g)).bfloat16().requires_grad_()
        labels = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
        reference = plain(hidden, weight, labels).detach()
        for name, fn in variants().items():
            ms, peak, loss = measure(fn, hidden, weight, labels)
            delta = (loss.float() - reference.float()).abs().item()
            rows.append({"shape": shape, "variant": name, "ms": ms, "peak_gib": peak, "loss_delta": delta})
            print(f"| {shape} | {name} | {ms:.2f} | {peak:.2f} | {delta:.1e} |", flush=True)
    if a.output:
        Path(a.output).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
