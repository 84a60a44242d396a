"""Muon's two ways of orthogonalising FSDP-sharded matrices, measured on gloo (CPU): the bytes each rank sends and
the time of an optimizer step, for muon_orthogonalize_on = "owner" (two all-to-alls per group of same-shaped
matrices, each orthogonalised on one rank) and "every_rank" (an all-gather per matrix, each orthogonalised on every
rank).

    python3 scripts/muon_comm.py [--ranks 2 4] [--dim 256] [--layers 4] [--repeats 3]

The matrices are a Llama-style block's (wq, wk, wv, wo: dim x dim, dim/4 x dim twice, dim x dim; w1, w3: 8/3 dim x
dim rounded to 64; w2: its transpose) times --layers, each sharded by rows over the ranks (FSDP's Shard(0)), float32
with a bfloat16 Newton-Schulz iteration, as the optimizer runs them. Bytes: what each rank's collectives send
(all-gather: its shard to n - 1 ranks; all-to-all: all but its own part), counted on the ops DTensor issues. Time:
the median of --repeats steps after one to warm up; "comm" is the same step with 0 Newton-Schulz iterations (the
collectives and the copies around them), "step" the whole step with 5. It also checks that both ways leave the
same weights (bit for bit). Figures from one run are in docs/optimizers.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from titanlite.components.muon import Muon


class SentBytes(TorchDispatchMode):
    """The bytes this rank's collectives send: DTensor's all-gathers (functional collectives, seen here as they are
    dispatched) and Muon's own all-to-alls (dist.all_to_all_single, counted by a wrapper while this is active)."""

    def __init__(self, world: int):
        super().__init__()
        self.world, self.sent = world, 0

    def __enter__(self):
        self.original = dist.all_to_all_single

        def counted(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kwargs):
            splits = input_split_sizes or [input.numel() // self.world] * self.world
            own = splits[dist.get_rank(group)]
            self.sent += (sum(splits) - own) * input.element_size()
            return self.original(output, input, output_split_sizes, input_split_sizes, group=group, **kwargs)

        dist.all_to_all_single = counted
        return super().__enter__()

    def __exit__(self, *exc):
        dist.all_to_all_single = self.original
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "all_gather_into_tensor" in str(func):
            self.sent += args[0].numel() * args[0].element_size() * (self.world - 1)
        return func(*args, **(kwargs or {}))


def shapes(dim: int, layers: int) -> list[tuple[int, int]]:
    hidden = (8 * dim // 3 + 63) // 64 * 64
    block = [(dim, dim), (dim // 4, dim), (dim // 4, dim), (dim, dim), (hidden, dim), (hidden, dim), (dim, hidden)]
    return block * layers + [(dim + 3, dim)]  # and one whose rows split unevenly


def worker(rank: int, world: int, init: str, args, out) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    generator = torch.Generator().manual_seed(0)
    full = [torch.randn(shape, generator=generator) for shape in shapes(args.dim, args.layers)]
    rows, weights = {}, {}
    for mode in ("owner", "every_rank"):
        for ns_steps in (0, 5):
            params = [torch.nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)])) for t in full]
            for p, t in zip(params, full):
                p.grad = distribute_tensor(t * 0.01, mesh, [Shard(0)])
            optimizer = Muon(params, lr=0.01, ns_steps=ns_steps, orthogonalize_on=mode)
            optimizer.step()  # warm-up: the momentum buffers, the first collectives
            counter = SentBytes(world)
            with counter:
                optimizer.step()
            times = []
            for _ in range(args.repeats):
                dist.barrier()
                start = time.perf_counter()
                optimizer.step()
                dist.barrier()
                times.append(time.perf_counter() - start)
            rows[(mode, ns_steps)] = (counter.sent, statistics.median(times))
            weights[(mode, ns_steps)] = [p.full_tensor() for p in params]
    same = all(torch.equal(a, b) for ns in (0, 5) for a, b in zip(weights[("owner", ns)], weights[("every_rank", ns)]))
    if rank == 0:
        out.put((rows, same))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    matrices = shapes(args.dim, args.layers)
    elements = sum(a * b for a, b in matrices)
    print(f"{len(matrices)} matrices of a dim-{args.dim} Llama block x {args.layers}: {elements * 4 / 2**20:.1f} MiB")
    print(f"{'ranks':>5} {'way':>10} {'sent MiB/rank':>14} {'comm ms':>8} {'step ms':>8}")
    context = mp.get_context("spawn")
    for world in args.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            queue = context.SimpleQueue()
            init = f"file://{tmp}/rendezvous"
            mp.spawn(worker, args=(world, init, args, queue), nprocs=world, join=True)
            rows, same = queue.get()
        for mode in ("owner", "every_rank"):
            sent, comm = rows[(mode, 0)]
            _, step = rows[(mode, 5)]
            print(f"{world:>5} {mode:>10} {sent / 2**20:>14.2f} {comm * 1e3:>8.1f} {step * 1e3:>8.1f}")
        print(f"{world:>5} the two ways' weights after the steps are {'equal' if same else 'DIFFERENT'}")


if __name__ == "__main__":
    main()
