"""The mixture-of-experts block alone, forward and backward: its routed experts on `torch._grouped_mm` against the
loop over experts that it falls back to where the grouped kernel does not run (titanlite/models/common/moe/layer.py).

    python3 scripts/bench_moe.py [--device cpu|cuda] [--dtype float32|bfloat16] [--output moe.json]

Each shape is (tokens, dim, experts, top-k, expert width), a Qwen3-MoE-like block at a CPU-sized width and, on
CUDA, Qwen3-30B-A3B's own (dim 2048, 128 experts, top-8, 768 wide). Both paths get the same weights and tokens
and must give the same output (checked to a tolerance first). Timed after 3 warm-up calls: the median of 10 wall
times (CUDA: synchronised) of one forward and backward; tokens/s = tokens / that median.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

from titanlite.models.common.moe.args import MoEArgs
from titanlite.models.common.moe.layer import MoE, grouped_mm_runs

SHAPES = {  # name: (tokens, dim, experts, top_k, expert_dim)
    "small 4k tokens": (4096, 256, 8, 2, 512),
    "qwen3-moe-like 4k tokens": (4096, 512, 32, 4, 256),
}
CUDA_SHAPES = {"qwen3-30b-a3b block 16k tokens": (16384, 2048, 128, 8, 768)}


def step_seconds(block: MoE, x: torch.Tensor, repeats: int = 10, warmup: int = 3) -> float:
    times = []
    for i in range(warmup + repeats):
        if x.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        block(x).float().pow(2).mean().backward()
        if x.is_cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench(name: str, shape: tuple, device: torch.device, dtype: torch.dtype) -> dict:
    tokens, dim, experts, top_k, hidden = shape
    args = MoEArgs(n_experts=experts, top_k=top_k, expert_dim=hidden, norm_topk_prob=True, balance="none")
    torch.manual_seed(0)
    grouped = MoE(dim, args, use_grouped_mm=True).to(device=device, dtype=dtype)
    grouped.reset_parameters()
    loop = copy.deepcopy(grouped)
    loop.experts.use_grouped_mm = False
    x = torch.randn(1, tokens, dim, device=device, dtype=dtype)
    with torch.no_grad():
        diff = (grouped(x).float() - loop(x).float()).abs().max().item()
    row = {"shape": name, "tokens": tokens, "dim": dim, "experts": experts, "top_k": top_k, "expert_dim": hidden}
    row["max_abs_diff"] = diff
    for label, block in (("grouped", grouped), ("loop", loop)):
        seconds = step_seconds(block, x)
        row[f"{label}_ms"] = 1e3 * seconds
        row[f"{label}_tokens_s"] = tokens / seconds
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--output", type=Path)
    opts = parser.parse_args()
    device, dtype = torch.device(opts.device), getattr(torch, opts.dtype)
    if not grouped_mm_runs(device, dtype):
        raise SystemExit(f"bench_moe: torch._grouped_mm does not run on {device} in {opts.dtype} here")
    shapes = {**SHAPES, **(CUDA_SHAPES if device.type == "cuda" else {})}
    print(f"bench_moe: {device}, {opts.dtype}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'shape':<32} {'max diff':>9} {'grouped ms':>11} {'loop ms':>9} {'grouped tok/s':>14} {'loop tok/s':>11}")
    rows = []
    for name, shape in shapes.items():
        r = bench(name, shape, device, dtype)
        rows.append(r)
        print(
            f"{name:<32} {r['max_abs_diff']:>9.1e} {r['grouped_ms']:>11.1f} {r['loop_ms']:>9.1f} "
            f"{r['grouped_tokens_s']:>14,.0f} {r['loop_tokens_s']:>11,.0f}"
        )
    if opts.output:
        opts.output.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
