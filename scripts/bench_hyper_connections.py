"""What DeepSeek-V4's hyper-connections cost a layer on this machine's CPU: the two of a layer (the mixer's and the
feed-forward's: their read of the streams, Sinkhorn's mixing and their write back) forward and backward, against the
plain residual adds they replace, for `n` streams of `dim` channels over one sequence of `tokens`. The sublayers
themselves are left out (an identity in their place), so the figures are the connections' own.

    python3 scripts/bench_hyper_connections.py [--dim 64 4096] [--streams 4] [--tokens 4096] [--repeats 5]

Prints per case: the median time of a layer's connections forward and backward, the plain residual's, and the bytes
the connections keep for backward (measured: the tensors autograd saves), against the residual's (none)."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from titanlite.models.common.hyper_connections import HyperConnection, widen_streams


def saved_bytes(fn) -> int:
    """The bytes of the distinct tensors autograd saves while `fn()` runs."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[id(t.untyped_storage())] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def case(dim: int, n: int, tokens: int, repeats: int) -> dict:
    torch.manual_seed(0)
    connections = [HyperConnection(n, dim, iterations=20, eps=1e-6, norm_eps=1e-6) for _ in range(2)]
    for c in connections:
        for p in c.parameters():
            torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(1, tokens, dim)

    def hyper() -> torch.Tensor:
        streams = widen_streams(x, n).requires_grad_()
        for c in connections:  # the mixer's, then the feed-forward's; an identity for each sublayer
            read, post, comb = c(streams)
            streams = HyperConnection.write(streams, read, post, comb)
        return streams

    def plain() -> torch.Tensor:
        h = x.clone().requires_grad_()
        for _ in connections:
            h = h + h  # the residual add, an identity sublayer
        return h

    def step(fn):
        return lambda: fn().sum().backward()

    return {
        "dim": dim,
        "streams": n,
        "tokens": tokens,
        "hyper_ms": 1e3 * median_seconds(step(hyper), repeats),
        "plain_ms": 1e3 * median_seconds(step(plain), repeats),
        "hyper_saved_mib": saved_bytes(hyper) / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, nargs="+", default=[64, 4096])
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"{'dim':>6}{'streams':>8}{'tokens':>8}{'connections ms':>16}{'residual ms':>13}{'saved MiB':>11}")
    for dim in args.dim:
        row = case(dim, args.streams, args.tokens, args.repeats)
        print(
            f"{row['dim']:>6}{row['streams']:>8}{row['tokens']:>8}{row['hyper_ms']:>16.2f}{row['plain_ms']:>13.2f}"
            f"{row['hyper_saved_mib']:>11.1f}"
        )


if __name__ == "__main__":
    main()
